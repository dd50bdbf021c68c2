"""The seeded book and the `read` tool: determinism, gold mentions that match the text, bad input.

Run: python -m pytest tests/tasks/test_book.py -q
"""

import pytest

from minagent import tools
from minagent.tasks.context import book
from minagent.tools import MAX_RESULT, Toolbox


def test_deterministic_and_seed_dependent():
    assert book.chapter(0, 3) == book.chapter(0, 3)
    assert book.chapter(0, 3) != book.chapter(1, 3)
    assert book.chapter(0, 3) != book.chapter(0, 4)
    assert len({book.chapter(0, n) for n in range(1, book.N_CHAPTERS + 1)}) == book.N_CHAPTERS
    assert book.chapter(5, 7).startswith("Chapter 7. ")


def test_mentions_match_the_text():
    """The gold answer is what a reader finds: a chapter mentions a motif iff its word is in the text."""
    seen = {m: 0 for m in book.MOTIFS}
    for seed in range(5):
        for motif in book.MOTIFS:
            gold = book.mentions(seed, motif, 1, book.N_CHAPTERS)
            found = [n for n in range(1, book.N_CHAPTERS + 1) if motif in book.chapter(seed, n)]
            assert gold == found
            seen[motif] += len(gold)
        every = book.mentions(seed, "lighthouse", 1, book.N_CHAPTERS)
        assert book.mentions(seed, "lighthouse", 5, 9) == [n for n in every if 5 <= n <= 9]
    for motif, n in seen.items():   # about MOTIF_P of 200 chapters each: neither none nor all
        assert 30 < n < 100, (motif, n)


def test_chapter_length_and_motif_sentences():
    for n in range(1, 11):
        text = book.chapter(2, n)
        assert text.count(".") == 1 + book.SENTENCES      # the heading, then the sentences
        assert book.chapter(2, n, sentences=4).count(".") == 1 + 4
        assert 300 < len(text) < 1200
    assert book.chapter(2, 1, sentences=0).count(".") == 1 + len(book.motifs(2, 1))   # motifs are never dropped


def test_bad_chapters_and_motifs():
    with pytest.raises(ValueError):
        book.chapter(0, 0)
    with pytest.raises(ValueError):
        book.chapter(0, book.N_CHAPTERS + 1)
    with pytest.raises(ValueError):
        book.mentions(0, "dragon", 1, 5)
    assert book.mentions(0, "fox", 5, 4) == []


@pytest.mark.parametrize("call, error", [
    ("read", "error: read takes a chapter number"),
    ("read 3 4", "error: read takes a chapter number"),
    ("read three", "error: not a number: three"),
    ("read 0", "error: no chapter 0: the book has chapters 1 to 40"),
    ("read 41", "error: no chapter 41: the book has chapters 1 to 40"),
    ("read -2", "error: no chapter -2: the book has chapters 1 to 40"),
])
def test_read_errors(call, error):
    assert book.toolbox(0)(call) == error


def test_read_returns_a_whole_chapter_of_this_episodes_book():
    box = book.toolbox(9)
    text = box("read 12")
    assert text == book.chapter(9, 12) and len(text) > MAX_RESULT    # not cut to MAX_RESULT
    assert box(" read  12 ") == text
    assert book.toolbox(9, sentences=3)("read 12") == book.chapter(9, 12, 3)
    long = book.toolbox(9, sentences=100)("read 1")          # still bounded, by MAX_READ
    assert len(long) == book.MAX_READ and long.endswith("...")


def test_read_is_not_a_default_tool():
    """The first four tools' behaviour, and the default toolbox, are unchanged."""
    assert Toolbox(0)("read 3") == "error: unknown tool read"
    assert book.toolbox(0)("add 1 2") == "error: unknown tool add"
    assert book.toolbox(0)("read 3").startswith("Chapter 3. Later, the keeper drove to")  # as in the docstring
    assert len(Toolbox(0)("sort " + "99 " * 16)) <= MAX_RESULT
