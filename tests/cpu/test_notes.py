"""NOTES.md is a notebook a newcomer can use: it opens with an index, each kernel's card fits
on one screen, and every log a card links to exists."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCREEN_LINES = 40


def _cards(text):
    index = text.index("## Index")
    body = text[index:].split("\n## ", 1)[0]  # the index section, up to the next level-2 heading
    return re.split(r"\n(?=### )", body)[1:]


def test_notes_open_with_an_index_of_cards_that_fit_on_a_screen():
    text = (ROOT / "NOTES.md").read_text()
    assert text.index("## Index") < 1500  # after the title and the ceilings paragraph only
    cards = _cards(text)
    assert len(cards) >= 8
    for card in cards:
        lines = card.strip().splitlines()
        assert len(lines) <= SCREEN_LINES, lines[0]
        assert "**What**" in card and "**Open**" in card, lines[0]


def test_every_linked_log_exists():
    links = re.findall(r"\]\((notes/[^)]+\.md)\)", (ROOT / "NOTES.md").read_text())
    assert links and all((ROOT / link).is_file() for link in links)
