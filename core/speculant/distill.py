"""Self-distillation data: the target's own answers to assistant requests built from local files.

A drafter trained on source code read back (``speculant.training``'s default recipe) learns code,
but at serving time it drafts the target's *answers*: prose around code, code in other languages,
tables. On those its first-step accuracy fell from 0.54 (held-out read-back text) to 0.42 (the
EAGLE3 head of issue 18). This module writes what the drafter will meet: requests a coding
assistant gets, built without downloads from files already on the machine, answered greedily by
the target itself (temperature 0, as the served benchmarks decode), many at once.

Requests (:func:`requests`), in a fixed pseudo-random order of the same source files:

- code requests over one top-level Python function of a source file (5-60 lines): port it to
  another language, add type hints or a docstring, write tests, explain it, refactor it, review it;
- specification requests: "write a <language> program that does this", from a function's
  docstring summary;
- data requests over records of the installed distributions' metadata (name, version, summary,
  license, Python requirement) as JSON or CSV: render them as a Markdown table, CSV, YAML or a
  list, pick or sort fields.

A second kind, ``kind="scratch"`` (its own order and answers file), asks for code written from
scratch: an equivalent of a documented class or function of those files in another language, a
demo program or a small library for what its docstring says, with or without "only code". A
drafter meets such answers often (nothing in the request to copy), and the assistant kind above
holds few: the EAGLE3 head trained on it was right 0.60 of the time at its first step on unseen
requests of that kind, and its first draft token was accepted 0.27-0.53 of the time on
from-scratch asks (docs/benchmarks.md, twentieth run). A third kind, ``kind="tasks"``, asks for
everyday programming tasks (an algorithm, a data structure, a small tool) from a catalog written
for this project, in eight languages (``speculant.distill_tasks``).

None of the benchmark workloads, nor text written for them, is among them: they are generic
assistant tasks over other inputs. :data:`SYSTEMS` holds the system prompts used (or none).

:func:`answer` writes ``answers.jsonl`` (one line per finished request: its index, the prompt ids
and the answer ids), resumably; :func:`documents` reads it back as whole chat turns for
``speculant.training.collect(recipe="self")``.
"""
from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import time
from importlib import metadata
from pathlib import Path
from typing import Iterator

from speculant.distill_tasks import TASK_ASKS, TASK_TAILS, TASKS
from speculant.sources import source_files

__all__ = ["CODE_ASKS", "DATA_ASKS", "KINDS", "SCRATCH_ASKS", "SPEC_ASKS", "SYSTEMS", "TASK_LANGUAGES", "answer", "documents",
           "requests"]

LANGUAGES = ("C", "C++", "Rust", "Go", "JavaScript", "Java", "TypeScript")
TASK_LANGUAGES = ("Python", *LANGUAGES)
SYSTEMS = (None, "You are a helpful assistant.", "You are a careful senior software engineer.",
           "Answer with code only, no explanations.", "You are a concise assistant for programmers.")
CODE_ASKS = (
    "Rewrite this Python function in {lang}.",
    "Port the following Python code to {lang}. Keep the same behaviour.",
    "Add type hints to this function and give me the complete result.",
    "Write pytest tests for this function.",
    "Explain what this function does, step by step.",
    "Add a docstring and comments to this function. Output the whole function.",
    "Refactor this function to be easier to read without changing what it does.",
    "Review this code: point out bugs or edge cases, then show a corrected version.",
    "Rename the variables of this function to clearer names and return the full code.",
)
SPEC_ASKS = (
    "Write a {lang} program that does the following: {spec}",
    "Implement this in {lang}: {spec}",
    "In Python, write a function `{name}` that does this: {spec}",
)
DATA_ASKS = (
    "Turn this JSON into a Markdown table showing {cols}.",
    "Convert this JSON list to CSV with a header row and the fields {cols}.",
    "Write this data as YAML.",
    "List the {col} of every entry below as a bulleted list.",
    "Sort these records by {col} and show them as a Markdown table.",
    "Convert this CSV to a JSON array of objects.",
)
SCRATCH_ASKS = (
    "Implement an equivalent of Python's `{module}.{name}` in {lang}: {summary}",
    "Write a {lang} program that demonstrates this: {summary}",
    "Write a small {lang} library for the following, with a short usage example: {summary}",
    "In {lang}, write `{name}`. What it does: {summary}",
    "Show me how to build this in {lang}, step by step: {summary}",
)
SCRATCH_TAILS = ("", " Only code, please.", " Just the code, no explanations.", " Keep it short.",
                 " Add comments where it helps.")
FIELDS = ("name", "version", "summary", "license", "requires_python")
KINDS = ("assist", "scratch", "tasks")


def _order(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _parsed(path: str) -> tuple[str, ast.Module] | None:
    """The file's text and syntax tree; None where it cannot be read or parsed as Python."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        return text, ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _documented(path: str) -> list[tuple[str, str]]:
    """(name, docstring summary of 30-300 characters) of the file's public top-level classes and functions."""
    parsed = _parsed(path)
    if parsed is None:
        return []
    out = []
    for node in parsed[1].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = " ".join((ast.get_docstring(node) or "").strip().split("\n\n")[0].split())
            if 30 <= len(doc) <= 300:
                out.append((node.name, doc))
    return out


def _module_name(path: str) -> str:
    """A dotted module name for `path` (its part under site-packages or the standard library)."""
    parts = Path(path).with_suffix("").parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + 1 :]
            break
    else:
        parts = parts[-2:] if len(parts) >= 2 and not parts[-2].startswith("python") else parts[-1:]
    parts = [p for p in parts if p != "__init__"]
    return ".".join(parts) or "module"


def _scratch_requests(globs: list[str]) -> Iterator[list[dict]]:
    k = 0
    for path in source_files(globs):
        if not path.endswith(".py"):
            continue
        for name, summary in _documented(path)[:2]:
            system = SYSTEMS[(k // 2) % len(SYSTEMS)]
            ask = SCRATCH_ASKS[(k // 7) % len(SCRATCH_ASKS)]
            lang = LANGUAGES[k % len(LANGUAGES)] if k % 6 or "Python's" in ask else "Python"
            ask = ask.format(module=_module_name(path), name=name, lang=lang, summary=summary)
            user = ask + SCRATCH_TAILS[(k // 3) % len(SCRATCH_TAILS)]
            k += 1
            yield ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _with_article(noun: str) -> str:
    return ("an " if noun[0].lower() in "aeio" or noun.startswith(("HTTP", "INI")) else "a ") + noun


def _task_requests() -> Iterator[list[dict]]:
    """Every (task, language) pair of the catalog once, in a fixed pseudo-random order, with the
    phrasing, tail and system prompt varying along the order."""
    pairs = sorted(((t, lang) for t in range(len(TASKS)) for lang in TASK_LANGUAGES),
                   key=lambda p: _order(f"{TASKS[p[0]][0]}|{p[1]}"))
    for k, (t, lang) in enumerate(pairs):
        task, what = TASKS[t]
        user = TASK_ASKS[k % len(TASK_ASKS)].format(a_task=_with_article(task), lang=lang, what=what,
                                                    what_cap=what[0].upper() + what[1:])
        user += TASK_TAILS[(k // len(TASK_ASKS)) % len(TASK_TAILS)]
        system = SYSTEMS[(k // 3) % len(SYSTEMS)]
        yield ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _functions(path: str) -> list[tuple[str, str, str]]:
    """(name, source, docstring summary) of the file's top-level functions of 5-60 lines."""
    parsed = _parsed(path)
    if parsed is None:
        return []
    text, tree = parsed
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            n = node.end_lineno - node.lineno + 1
            if 5 <= n <= 60:
                doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
                out.append((node.name, "\n".join(lines[node.lineno - 1 : node.end_lineno]), doc))
    return out


def _records() -> list[dict]:
    """The installed distributions' metadata, one record each, in a fixed order."""
    seen, out = set(), []
    for dist in metadata.distributions():
        m = dist.metadata
        name = m.get("Name")
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        out.append({"name": name, "version": m.get("Version") or "", "summary": (m.get("Summary") or "").strip()[:120],
                    "license": (m.get("License-Expression") or m.get("License") or "").strip().split("\n")[0][:40],
                    "requires_python": m.get("Requires-Python") or ""})
    return sorted(out, key=lambda r: _order(r["name"]))


def _data_request(k: int, records: list[dict]) -> str:
    n = 4 + k % 7
    start = (k * 7) % max(1, len(records) - n)
    rows = records[start : start + n]
    ask = DATA_ASKS[k % len(DATA_ASKS)]
    cols = [f for i, f in enumerate(FIELDS) if (k >> i) % 2 == 0 or f == "name"][:4]
    if "CSV to" in ask:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        w.writerows({c: r[c] for c in cols} for r in rows)
        body = buf.getvalue()
    else:
        body = json.dumps([{c: r[c] for c in FIELDS if c in cols or k % 3 == 0} for r in rows], indent=None if k % 2 else 1)
    return ask.format(cols=", ".join(cols), col=cols[(k // 3) % len(cols)]) + "\n" + body


def requests(globs: list[str], kind: str = "assist") -> Iterator[list[dict]]:
    """Chat requests (messages, without the answer), endlessly varied over the files of `globs`
    and the installed distributions; the same order on every run and machine with the same files.
    `kind`: "assist" (work on given code or data), "scratch" (code written from a description) or
    "tasks" (everyday programming tasks from ``speculant.distill_tasks``' catalog, 1000 requests;
    `globs` unused)."""
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}: one of {', '.join(KINDS)}")
    if kind == "tasks":
        yield from _task_requests()
        return
    if kind == "scratch":
        yield from _scratch_requests(globs)
        return
    records = _records()
    k = 0
    for path in source_files(globs):
        if not path.endswith(".py"):
            continue
        for name, code, doc in _functions(path)[:2]:
            system = SYSTEMS[k % len(SYSTEMS)]
            lang = LANGUAGES[(k // 3) % len(LANGUAGES)]
            if k % 5 == 4 and len(doc) > 30:
                user = SPEC_ASKS[k % len(SPEC_ASKS)].format(lang=lang, spec=doc, name=name)
            elif k % 5 == 2 and records:
                user = _data_request(k, records)
            else:
                user = CODE_ASKS[k % len(CODE_ASKS)].format(lang=lang) + f"\n```python\n{code}\n```"
            k += 1
            yield ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _done(path: Path) -> tuple[set[int], int]:
    """Indices already answered in `path` and the tokens they hold; a torn last line is dropped."""
    done, tokens = set(), 0
    if path.exists():
        good = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            good.append(line)
            done.add(row["index"])
            tokens += len(row["prompt"]) + len(row["answer"])
        path.write_text("".join(f"{g}\n" for g in good))
    return done, tokens


def answer(target, path: str, n_tokens: int, globs: list[str], *, batch: int = 8, max_tokens: int = 384,
           max_prompt: int = 1536, spec_types: str | None = None, start: int = 0, kind: str = "assist", recorder=None,
           log=print) -> int:
    """Append the target's greedy answers to `path` until its documents (prompt + answer) hold
    `n_tokens` tokens; `batch` requests decode at once. Resumes. Returns the tokens held.

    `spec_types` (the user's --spec-type list, default none): speculators that make the answers
    come sooner (many requests ask for their own code back, edited); the tokens are the same.
    `start`: the first request of :func:`requests`' order to answer (those before it are skipped);
    `kind`: which requests (:data:`KINDS`; one kind to a file, as the indices are the kind's own).
    `recorder` (a :class:`speculant.recording.StateRecorder`): rides in the engine's chain and is
    handed each answer as it is written; `n_tokens` then counts the rows it has handed on
    (``recorder.rows``) instead of the file's tokens."""
    from speculant.engine import Engine, EngineConfig
    from speculant.speculator import build_speculators, parse_spec_types

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done, tokens = _done(out)
    if recorder is not None:
        tokens = recorder.rows
    if tokens >= n_tokens:
        return tokens
    speculators = build_speculators(parse_spec_types(spec_types), {}, target)
    if recorder is not None:
        speculators.append(recorder)
    engine = Engine(target, EngineConfig(n_ctx=max_prompt + max_tokens + 8, spec_deadline=None), speculators)
    stream = ((i, m) for i, m in enumerate(requests(globs, kind)) if i >= start and i not in done)
    running, t0, made, n_docs = {}, time.time(), 0, len(done)
    with out.open("a") as f:
        while tokens < n_tokens or running:
            while tokens < n_tokens and len(running) < batch:
                item = next(stream, None)
                if item is None:
                    break
                i, messages = item
                ids = target.tokenizer.encode_chat(messages)
                if len(ids) <= max_prompt:
                    running[engine.add(ids, max_tokens).seq_id] = i
            if not running:
                break
            engine.step()
            for seq in [s for s in engine.sequences.values() if s.finish_reason is not None and s.seq_id in running]:
                answer_ids = seq.tokens[seq.n_prompt:]
                f.write(json.dumps({"index": running.pop(seq.seq_id), "prompt": seq.tokens[: seq.n_prompt],
                                    "answer": answer_ids, "finish": seq.finish_reason}) + "\n")
                f.flush()
                tokens += recorder.finish(seq.seq_id, seq.tokens) if recorder is not None else len(seq.tokens)
                made += len(answer_ids)
                n_docs += 1
                engine.release(seq)
                if n_docs % 25 == 0:
                    log(f"answer: {tokens} tokens in {n_docs} documents ({made / (time.time() - t0):.0f} answer tokens/s)")
    return tokens


def documents(path: str) -> Iterator[tuple[str, list[int]]]:
    """("answers.jsonl:<index>", prompt + answer ids) for each answered request, in file order."""
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            yield f"{path}:{row['index']}", row["prompt"] + row["answer"]
