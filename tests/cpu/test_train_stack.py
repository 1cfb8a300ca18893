"""The lab's training decoder (ws_lab/rollout/train_stack.py) on the CPU, fp32, the tiny Qwen2
config: against HF's decoder in float64, its hidden states and every parameter's gradient err
as HF's own fp32 decoder's do; on the lab's attention the compiled decoder is one graph."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.decoder_grads import errors_against_float64  # noqa: E402
from ws_lab.rollout import config  # noqa: E402
from ws_lab.rollout.train_stack import TrainingDecoder  # noqa: E402


def _model():
    return config.random_model(config.qwen2_config(config.TINY), torch.float32, "cpu").train()


def test_the_training_decoder_equals_hfs_forward_and_gradients():
    """Against HF's decoder in float64 (autograd through the reference), the lab's decoder in
    fp32 errs as HF's own fp32 decoder does (within 1.1 × its rel-L2, and under 1e-4), on the
    hidden states and every parameter's gradient."""
    hf = _model()
    lab_model = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.TINY["vocab_size"], (3, 11), generator=gen)
    weight = torch.randn(3, 11, config.TINY["hidden_size"], generator=gen, dtype=torch.float64)
    for name, lab, fp32 in errors_against_float64(TrainingDecoder(lab_model), lab_model, hf,
                                                  ids, weight):
        assert lab <= min(1e-4, 1.1 * fp32 + 1e-7), name


class _Traced(Exception):
    """Raised in place of running the graph that ``recording_backend`` was handed."""


def test_the_training_decoder_on_the_labs_attention_traces_as_one_graph():
    """With ``attn_implementation="ws_lab"`` the compiled decoder is one graph holding every
    layer's ``ws_lab.attention`` (fullgraph: a graph break raises while tracing, before the
    backend; the graph is not run, since the op's kernels need CUDA). An import inside the
    traced path once broke it at each layer, and past Dynamo's recompile limit the rest ran
    eager."""
    from ws_lab.rollout import hf_attention

    d64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # the op's D 64
    model = config.random_model(config.qwen2_config(config.TINY, **d64), torch.bfloat16, "cpu")
    model.set_attn_implementation(hf_attention.register())
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)

        def instead_of_running(*args):
            raise _Traced

        return instead_of_running

    compiled = torch.compile(TrainingDecoder(model), backend=recording_backend, fullgraph=True)
    with pytest.raises(_Traced):
        compiled(torch.randint(0, config.TINY["vocab_size"], (2, 9)))
    calls = [n for n in graphs[0].graph.nodes if "ws_lab.attention" in str(n.target)]
    assert len(graphs) == 1 and len(calls) == model.config.num_hidden_layers
    # q, k and v come straight out of rope_qkv in the op's (B, T, H, D): no transposing copy
    for call in calls:
        sources = {str(arg.args[0].target) for arg in call.args[:3]}
        assert len(sources) == 1 and "ws_lab.rope_qkv" in sources.pop(), call.args[:3]
