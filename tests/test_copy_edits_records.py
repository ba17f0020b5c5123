"""copy-edits' records: an answer that writes the prompt's records again in another layout (a line
each, or a few) gets its next records drafted, each record's values from the prompt."""
from __future__ import annotations

import json

from speculant import DraftLimits, SequenceView
from speculant.gguf.tokenizer import Tokenizer
from speculant.speculator import SpeculatorConfig
from speculant.testing.tiny_gguf import tiny_vocab

from speculant_edits import CopyEdits, RecordLines
from speculant_edits.records import Template, find_value

ITEMS = [{"name": f"tool-{i}", "lang": ["C", "Go", "Rust"][i % 3], "stars": 1000 + 37 * i, "url": f"https://x.org/{i}"}
         for i in range(6)]
PROMPT = "Make a Markdown table of name, lang and stars (C is fine):\n" + json.dumps(ITEMS)
ROWS = [f"| {it['name']} | {it['lang']} | {it['stars']} |" for it in ITEMS]


def test_the_next_rows_come_from_the_next_records():
    t = Template.learn(ROWS[0], ROWS[1], PROMPT)
    assert t is not None
    assert t.contexts == ('{"name": "', '", "lang": "', '", "stars": ')
    assert t.ends == ('", "lang', '", "star', ', "url":')
    assert t.text(PROMPT, 40) == ROWS[2] + "\n" + ROWS[3] + "\n"  # whole lines until 40 characters are written
    # after the last record the first field's context does not come again: the rest up to it
    assert Template.learn(ROWS[3], ROWS[4], PROMPT).text(PROMPT, 500) == ROWS[5] + "\n| "


def test_a_value_is_found_in_its_record_not_where_it_stands_first():
    """`C` stands in the instruction before any record, and `tool-0`'s `C` before `tool-3`'s:
    each line's values are placed in one record, the nearest after the line before's."""
    t = Template.learn(ROWS[2], ROWS[3], PROMPT)  # tool-3 is a C record
    assert t.text(PROMPT, 1) == ROWS[4] + "\n"
    assert find_value("tool-10 tool-1", "tool-1", 0) == 8  # whole words only


def test_lines_that_are_not_the_prompts_records_give_no_template():
    assert Template.learn("| name | lang | stars |", "|------|------|-------|", PROMPT) is None  # other literal text
    assert Template.learn(ROWS[0], ROWS[0], PROMPT) is None  # no field
    assert Template.learn("| tool-0 | C | 9 |", "| tool-1 | Go | 8 |", PROMPT) is None  # 9, 8: not the prompt's
    assert Template.learn("x = 1", "y = 2", PROMPT) is None
    assert Template.learn("| tool-0 | C |", "| tool-1 | Go | 1037 |", PROMPT) is None  # a value in one only


PEOPLE = [("Ada Lovelace", "London", "Analytical engines and the first program"), ("Alan Turing", "Wilmslow", "Computable numbers"),
          ("Grace Hopper", "New York City", "The first compiler, and COBOL"), ("Edsger Dijkstra", "Nuenen", "Shortest paths")]
CSV = "name,city,known for\n" + "".join(f'"{n}","{c}","{k}"\n' for n, c, k in PEOPLE)


def test_values_of_several_words_are_one_field():
    rows = [f"- **{n}** ({c}): {k}" for n, c, k in PEOPLE]
    t = Template.learn(rows[0], rows[1], CSV)
    assert t is not None and len(t.contexts) == 3
    assert t.text(CSV, 1) == rows[2] + "\n"  # "New York City", "The first compiler, and COBOL"


MODULES = [{"module": m, "lines": n, "doc": d} for m, n, d in [
    ("colorsys", 166, "Conversion functions between RGB and other color systems."), ("fnmatch", 185, "Filename matching."),
    ("glob", 251, "Filename globbing utility."), ("shelve", 243, "Manage shelves of pickled objects.")]]
MODULES_JSON = "Write these modules out:\n" + json.dumps(MODULES)


def test_a_context_starts_after_the_value_before_it():
    """In `"fnmatch": 185,` the first value the prompt holds is `fnmatch"` (its quote too); the
    second field's context is looked for from there, so it may not reach back over that quote."""
    rows = [f'    "{m["module"]}": {m["lines"]},' for m in MODULES]
    t = Template.learn(rows[0], rows[1], MODULES_JSON)
    assert t.contexts[1] == ', "lines": '
    assert t.text(MODULES_JSON, 1) == rows[2] + "\n"


def test_a_separator_between_values_is_literal():
    """CSV: `185,Filename` holds `185,` of the prompt's `185, "doc"`, but a value follows, so the
    comma is the separator; free text that shares words with the record before is one value."""
    rows = [f'{m["module"]},{m["lines"]},{m["doc"]}' for m in MODULES]
    t = Template.learn(rows[0], rows[1], MODULES_JSON)
    assert t is not None and t.parts[1:] == (0, ",", 1, ",", 2, "")
    assert t.text(MODULES_JSON, 1) == rows[2] + "\n"


def test_records_of_several_lines():
    """A record written as three lines (YAML): learned from the last two records, drafted from
    any line of the current one."""
    items = [f"- name: {n}\n  city: {c}\n  known_for: {k}" for n, c, k in PEOPLE]
    t = Template.learn(items[0], items[1], CSV)
    assert t is not None and t.text(CSV, 1) == items[2] + "\n"
    text = "people:\n" + items[0] + "\n" + items[1] + "\n" + items[2][:30]
    lines = RecordLines(TOK, tokens(CSV))
    current, ahead = lines.ahead(text.split("\n"), complete_first=True)
    assert text.endswith(current)  # the record's lines so far (a template may start at any of its lines)
    assert (text + ahead[len(current) :]).startswith("people:\n" + "\n".join(items) + "\n")


TOK = Tokenizer.from_metadata(tiny_vocab("gpt2"))


def tokens(text: str) -> tuple[int, ...]:
    return tuple(TOK.encode(text, add_special=False, parse_special=False))


def test_the_draft_is_the_models_tokens_of_the_next_lines():
    prompt = tokens(PROMPT)
    lines = RecordLines(TOK, prompt)
    answer = "```\n" + ROWS[0] + "\n" + ROWS[1] + "\n| tool-2 | R"
    draft = lines.draft(tokens(answer), 16)
    whole = tokens(answer + "ust | 1074 |\n" + ROWS[3])
    assert len(draft) == 16 and tokens(answer) + draft == whole[: len(tokens(answer)) + 16]
    # a line that leaves the template (here its second value) is not drafted on
    assert lines.draft(tokens("```\n" + ROWS[0] + "\n" + ROWS[1] + "\n| tool-2 | Go"), 16) is None


def test_copy_edits_drafts_records_where_the_answer_does_not_copy():
    class Target:
        tokenizer = TOK

    prompt = tokens(PROMPT)
    seq = SequenceView(1, prompt + tokens(ROWS[0] + "\n" + ROWS[1] + "\n"), len(prompt))
    spec = CopyEdits(SpeculatorConfig("copy-edits", {}, Target()))
    spec.begin(seq)
    draft = spec.propose(seq, DraftLimits(n_max=8))
    assert draft is not None and TOK.decode(draft.tokens) == "| tool-2 | Rust |"[: len(TOK.decode(draft.tokens))]
    assert len(draft.tokens) == 8
    off = CopyEdits(SpeculatorConfig("copy-edits", {"spec_copy_edits_no_records": True}, Target()))
    off.begin(seq)
    assert off.propose(seq, DraftLimits(n_max=8)) is None
    # copying the prompt (a code edit): its copy is suffix's, the records are left alone
    copying = SequenceView(2, prompt + prompt[:40], len(prompt))
    spec.begin(copying)
    assert spec.propose(copying, DraftLimits(n_max=8)) is None
