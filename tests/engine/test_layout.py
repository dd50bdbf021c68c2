"""The repository's shape: the engine imports no application, and nothing points outside the repository.

    python -m pytest tests/engine/test_layout.py -q
"""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = sorted(p for p in (ROOT / "minagent").glob("*.py") if p.name != "__main__.py")   # the front door may


def imported_modules(path):
    """Every module a file imports, absolute: "from minagent.tasks import shop" -> minagent.tasks.shop."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_no_engine_module_imports_an_application():
    assert len(ENGINE) >= 12
    for path in ENGINE:
        tasks = [m for m in imported_modules(path) if m.startswith("minagent.tasks")]
        assert not tasks, f"{path.name} imports {tasks}: the engine must not know its applications"


def code_lines(path):
    """Lines that hold code: not blank, not only a comment, not part of a docstring. A limit on these
    keeps the reader's path short without ever asking an explanation to be cut."""
    text = path.read_text(encoding="utf-8")
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    prose = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    code = set()
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type not in prose:
            code.update(range(t.start[0], t.end[0] + 1))
    return len(code - docstrings)


def test_code_lines_count_code_only():
    sample = ROOT / "minagent" / "cache.py"
    total = len(sample.read_text(encoding="utf-8").splitlines())
    assert 0 < code_lines(sample) < total


def test_the_engine_stays_small_enough_to_read():
    """Lines of code (docstrings, comments and blank lines not counted): the engine (every module
    directly in minagent/) at most 2,240, the reader's path through it (README, "Reading order") at
    most 1,120. Set from the code of 2026-12-02 once wrapped at 100 columns (1,998 and 993), with
    room for a few more checks; the engine's raised from 2,100 on 2026-12-05 for int8's one-row
    product (two lines, off the reader's path, that halve a decode step at batch 1 on CPUs without
    VNNI), and to 2,120 on 2026-12-06 for an episode's stretch in one call (decode_steps as a
    while loop that keeps int8's conversion inside it, the loop's choice, the warm-up of its
    shapes: 14 lines that take the trip to the host off every token of an episode alone), and to
    2,130 on 2026-12-06 for bfloat16 matrices (bf16.py's 6 lines, off the reader's path, and one
    in model.dense, which puts the path at its 1,050: they take a third or more off a batch's time
    on a CPU with AVX512_BF16), and to 2,140 on 2026-12-06 for int8 with bfloat16 beside (int8.py's
    7 lines, off the reader's path: a sequence alone reads the bfloat16 copies in its prefill calls
    and the int8 values in its decode steps; 64 episodes one at a time on such a CPU, 18.4-18.9 s
    -> 15.8 s). Both raised on 2026-12-07, to 2,210 and 1,100, for a prefill beside the decode step
    (71 lines, 47 on the path: extend for several groups of rows in one call, the step that uses it,
    the Batch leaving a few short chunks to the decode step, the Runner's shapes): one pass over
    the weights where there were two, 42 prefill calls -> 22 for 64 episodes of SmolLM2, the
    batch's first measured step toward its 3x. Both raised on 2026-12-07 later, to 2,240 and
    1,115, for packed calls (31 lines, 15 on the path: extend_groups gathering a call's real
    tokens before the per-token parts and scattering the queries back for attention, the steps'
    static argument, the Runner's counts): a fifth of a 64-episode batch's positions were
    padding, and the batch alone ran 7.0-7.8 s -> 6.4-6.8 s with them. The path raised to 1,120 on
    2026-12-07 for decode.argmax (5 lines): greedy sampling in two reductions XLA on CPU runs on
    vectors, 7.2 -> 2.8 ms for a 64-row step's logits. The engine's raised to 2,250 on 2026-12-07
    for RunnerConfig.beside_rows (6 lines, off the reader's path): more of a prefill waits for the
    decode step's call, 66 calls -> 53 and about a tenth off 64 packed episodes on 2 cores. A
    clear sentence never counts against them."""
    path = ["tokenizer", "model", "cache", "decode", "batch", "agent"]
    assert sum(code_lines(p) for p in (ROOT / "minagent").glob("*.py")) <= 2250
    assert sum(code_lines(ROOT / "minagent" / f"{name}.py") for name in path) <= 1120


def test_the_readmes_line_counts_are_the_codes():
    """The README's table of the engine gives each file's lines of code: they are code_lines' count
    now, and so are its two sums (the reader's path, the whole engine)."""
    rows = [line.split("|") for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and ("](minagent/" in line or "*the " in line)]
    path_sum = engine_sum = None
    listed = 0
    for cells in rows:
        number = int(cells[3].strip(" *").replace(",", ""))
        files = re.findall(r"\]\(minagent/(\w+\.py)\)", cells[2])
        if files:
            assert number == sum(code_lines(ROOT / "minagent" / f) for f in files), cells[2]
            listed += number
            if cells[1].strip():                   # numbered: on the reader's path
                path_sum = listed
        elif "the path above" in cells[2]:
            assert number == path_sum
        elif "the engine" in cells[2]:
            engine_sum = number
    assert engine_sum == sum(code_lines(p) for p in (ROOT / "minagent").glob("*.py"))


def test_no_engine_line_is_wider_than_100_columns():
    """Code, docstrings and comments alike: a reader never scrolls sideways in the engine."""
    wide = [f"{p.name}:{i}" for p in (ROOT / "minagent").glob("*.py")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 100]
    assert not wide, wide


def test_imported_modules_reads_every_form():
    here = imported_modules(ROOT / "minagent" / "tasks" / "context" / "fit.py")
    assert "minagent.agent" in here and "minagent.chat.Message" in here


# Text that points outside the repository: the developers' own notes, issue trackers, a machine's paths.
# Spelled in pieces so that this file, which the test reads too, does not match what it hunts.
NOTES = "S" + "PEC"     # the developers' own notes, by name
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", rf"\b{NOTES}\b", rf"(?i:\bthe {NOTES}\b|\b{NOTES}'s\b)",
                               "/" + "work/", r"/home/\w+/", r"(?i:\bissue #?\d)"]))


def test_nothing_points_outside_the_repository():
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".toml", ".sh", ".txt")
             and not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
             and "results" not in p.parts]
    assert len(files) > 40
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in files
             for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "\n".join(found[:20])


PATH = ["tokenizer", "model", "cache", "decode", "mesh", "runner", "batch", "agent"]   # the reader's order


def minagent_imports(path, top_level_only=False):
    """The engine modules a file imports: "from minagent.batch import Batch" -> {"batch"}."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minagent"):
            parts = node.module.split(".")
            found |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("minagent.")}
    return {name for name in found if (ROOT / "minagent" / f"{name}.py").exists()}


def test_imports_run_one_way():
    """Along the reader's path a module imports only modules before it; across the whole engine the
    imports form no circle; and every import is at the top of its module (none hides in a function,
    where it could dodge a circle)."""
    graph = {p.stem: minagent_imports(p) for p in ENGINE}
    for i, name in enumerate(PATH):
        later = graph[name] & set(PATH[i + 1:])
        assert not later, f"{name}.py imports {sorted(later)}, which come after it"
    for p in ENGINE:
        assert minagent_imports(p) == minagent_imports(p, top_level_only=True), f"{p.name}: an import inside code"
    done, visiting = set(), []

    def visit(name):
        assert name not in visiting, f"an import circle: {' -> '.join(visiting + [name])}"
        if name not in done:
            visiting.append(name)
            for other in graph.get(name, ()):
                visit(other)
            visiting.pop()
            done.add(name)
    for name in graph:
        visit(name)
    assert "decode" not in graph["train"] and "runner" not in graph["train"]     # training pulls in no decoding
