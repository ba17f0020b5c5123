"""copy-edits: the answer's own changes of the text it copies, made again where that text comes again."""
from __future__ import annotations

import pytest

from speculant import DraftLimits, SequenceView
from speculant.speculator import SpeculatorConfig

from speculant_edits import CopyEdits
from speculant_edits.alignment import Alignment

# A prompt with two functions of the same signature: def f ( a , x ) : BODY1 / def g ( a , x ) : BODY2.
DEF, F, G, OPEN, A, COMMA, X, CLOSE, COLON = 1, 2, 3, 4, 5, 6, 7, 8, 9
BODY1, BODY2 = (20, 21, 22, 23, 24), (30, 31, 32, 33, 34)
PROMPT = (DEF, F, OPEN, A, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN, A, COMMA, X, CLOSE, COLON, *BODY2)
HINT = (50, 51)  # ": List", inserted after the first parameter


def test_an_insertion_is_made_again_where_the_same_text_comes():
    a = Alignment(PROMPT)
    # the answer copies f with a hint after `a`, then copies on into g's signature
    a.take((DEF, F, OPEN, A, *HINT, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN))
    assert a.copying and len(a.book) == 1
    assert a.draft(6) == (A, *HINT, COMMA, X, CLOSE)  # the hint where g's `a` is followed by `, x`
    assert a.draft(1) is None  # the change lies past the draft: a plain copy is any copying speculator's


def test_edits_are_made_on_copies_of_the_prompt_only():
    """The same answer as above, but the text it writes again with the hint is its own (the
    prompt holds other text): the change is recorded, and not made where its own text comes again
    (on answers written from scratch such drafts were wrong at once, see Alignment.draft)."""
    a = Alignment((90, 91, 92, 93))
    a.take(PROMPT + (DEF, F, OPEN, A, *HINT, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN))
    assert a.copying and len(a.book) == 1
    assert a.draft(6) is None
    assert a.draft(6, copies=True) == (A, COMMA, X, CLOSE, COLON, *BODY2[:1])  # the plain copy, where asked for


def test_a_replacement_of_several_tokens_applies_in_other_text_around_it():
    Y = 10  # `x y`: a name of two tokens
    prompt = (DEF, F, OPEN, A, COMMA, X, Y, CLOSE, *BODY1, 40, A, COMMA, X, Y, 41, *BODY2)
    a = Alignment(prompt)
    # `a , x y` written as `a , 60 61 62` (renamed), then the copy goes on
    a.take((DEF, F, OPEN, A, COMMA, 60, 61, 62, CLOSE, *BODY1, 40))
    assert a.draft(5) == (A, COMMA, 60, 61, 62)  # after `,` again, though `)` no longer follows


def test_nothing_is_drafted_where_no_change_applies_or_the_answer_writes_its_own_text():
    a = Alignment(PROMPT)
    a.take((DEF, F, OPEN, A, COMMA))
    assert a.copying and a.draft(8) is None  # copying, no change recorded: a plain copy is suffix's
    assert a.draft(8, copies=True) == (X, CLOSE, COLON, *BODY1)
    a.take((DEF, F, OPEN, A, COMMA, 99, 98))
    assert not a.copying and a.draft(8, copies=True) is None


def test_a_long_stretch_of_new_text_is_not_recorded_as_a_change():
    a = Alignment(PROMPT)
    new_text = tuple(range(100, 100 + 140))  # longer than MAX_DST
    a.take((DEF, F, OPEN, A, *new_text, COMMA, X, CLOSE, COLON))
    assert a.copying and len(a.book) == 0


def spec(**options) -> CopyEdits:
    return CopyEdits(SpeculatorConfig("copy-edits", options=options))


def test_the_speculator_follows_the_sequence_and_starts_again_when_it_is_cut():
    s = spec()
    prompt_then = lambda *out: SequenceView(0, PROMPT + out, len(PROMPT))
    out = (DEF, F, OPEN, A, *HINT, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN)
    draft = s.propose(prompt_then(*out), DraftLimits(n_max=4))
    assert draft.tokens == (A, *HINT, COMMA) and draft.spec_type == "copy-edits"
    # the history cut back (a new request on the same sequence): rebuilt from the tokens
    s.truncate(prompt_then(), len(PROMPT))
    assert s.propose(prompt_then(DEF, F), DraftLimits(n_max=4)) is None
    assert s.propose(prompt_then(*out), DraftLimits(n_max=0)) is None


@pytest.mark.parametrize("bad", [0, 65, "4", True])
def test_a_bad_resync_option_is_a_clear_error(bad):
    from speculant import SpeculantError

    with pytest.raises(SpeculantError, match="--spec-copy-edits-resync must be an integer in"):
        spec(spec_copy_edits_resync=bad)


def test_a_change_the_answer_does_not_make_again_is_no_longer_drafted():
    """A docstring added under one signature is not the next one's: once the answer comes to where
    a change applies and makes another one there (or none), the change is not drafted again until
    it is made as often as not."""
    a = Alignment(PROMPT + (DEF, 11, OPEN, A, COMMA, X, CLOSE, COLON, *BODY2))
    a.take((DEF, F, OPEN, A, *HINT, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN))
    assert a.draft(6) == (A, *HINT, COMMA, X, CLOSE)
    a.take((DEF, F, OPEN, A, *HINT, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN, A, COMMA))  # g's `a`: no hint
    a.take((DEF, F, OPEN, A, *HINT, COMMA, X, CLOSE, COLON, *BODY1, DEF, G, OPEN, A, COMMA, X, CLOSE, COLON, *BODY2, DEF, 11, OPEN))
    assert a.draft(6) is None  # not made at g: no longer drafted at the next signature
