"""The default verifier: a synthetic arithmetic task whose prompts and answers the code makes
(no dataset, no tokenizer download). Token ids 0–9 are digits, then '+', '=', EOS; every prompt
is the same fixed-length preamble (random ids, one draw per task) followed by "a+b=" with a and b
zero-padded to ``digits``, so all prompts have one length. A completion earns 1 when its digits
before the first EOS spell a + b, else 0. Other verifiers are any callable
``(prompts, completions) -> rewards (B,) float``."""
from dataclasses import dataclass

import torch

PLUS, EQUALS, EOS = 10, 11, 12


@dataclass(frozen=True)
class ArithmeticTask:
    vocab_size: int
    prompt_len: int = 200
    digits: int = 3
    seed: int = 0

    def __post_init__(self):
        if self.vocab_size <= EOS or self.prompt_len < 2 * self.digits + 2:
            raise ValueError(f"vocab_size > {EOS} and prompt_len ≥ {2 * self.digits + 2} needed")

    @property
    def eos_id(self) -> int:
        return EOS

    def prompts(self, count: int, device="cpu", generator=None):
        """(prompts (count, prompt_len) int64, the operands (count, 2))."""
        gen = generator or torch.Generator().manual_seed(self.seed + 1)
        operands = torch.randint(0, 10 ** self.digits, (count, 2), generator=gen)
        preamble = torch.randint(EOS + 1, self.vocab_size, (self.prompt_len - 2 * self.digits - 2,),
                                 generator=torch.Generator().manual_seed(self.seed))
        rows = [torch.cat([preamble, _digits(a, self.digits), torch.tensor([PLUS]),
                           _digits(b, self.digits), torch.tensor([EQUALS])])
                for a, b in operands.tolist()]
        return torch.stack(rows).to(device), operands

    def rewards(self, operands, completions) -> torch.Tensor:
        """1.0 where the completion's digits before its first EOS are a + b, else 0.0."""
        out = []
        for (a, b), row in zip(operands.tolist(), completions.tolist()):
            text = row[:row.index(EOS)] if EOS in row else row
            out.append(float(bool(text) and all(t < 10 for t in text)
                             and int("".join(map(str, text))) == a + b))
        return torch.tensor(out)


def _digits(value: int, width: int) -> torch.Tensor:
    return torch.tensor([int(c) for c in str(value).zfill(width)])
