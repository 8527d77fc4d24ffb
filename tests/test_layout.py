"""The codebase's own structure: who may import whom, one place per fact, start-up cost.

These read the source with ``ast`` (nothing is executed but the start-up check), so a
rule broken anywhere in ``opfuse/`` fails here with the file and line.
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
import pathlib
import re
import subprocess
import sys

import pytest

import opfuse
from opfuse.passes import REGISTRY, pass_class
from opfuse.passes.base import OpfusePass
from opfuse.core.ops import ACTIVATION_OPS, ELEMENTWISE_KINDS, OP_KINDS, OpKind

PACKAGE = pathlib.Path(opfuse.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))
# the optimiser: everything `opfuse optimize` runs
OPTIMISER = ("pipeline", "core", "prepare", "passes", "verify", "targets", "cost", "report", "load", "save",
             "quantization", "tune")


@functools.cache
def _source(path: pathlib.Path) -> str:
    return path.read_text()


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests here that read it (none changes it)."""
    return ast.parse(_source(path))


@functools.cache
def _nodes(path: pathlib.Path) -> tuple[ast.AST, ...]:
    """Every node of :func:`_tree`, in ``ast.walk``'s order."""
    return tuple(ast.walk(_tree(path)))


@pytest.fixture(scope="module", autouse=True)
def _parsed_once():
    """The trees are kept while this file's tests run, not for the rest of the session."""
    yield
    for cached in (_source, _tree, _nodes):
        cached.cache_clear()


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_optimiser_never_imports_the_benchmarks_the_torch_wing_or_the_cli():
    broken = []
    for path in MODULES:
        name = _module_name(path)
        if not _in(name, *(f"opfuse.{m}" for m in OPTIMISER)):
            continue
        for line, imported in _imports(path):
            if _in(imported, "opfuse.bench"):
                broken.append(f"{path.relative_to(PACKAGE)}:{line} imports {imported}")
            if _in(name, "opfuse.passes") and _in(imported, "opfuse.torch", "opfuse.cli"):
                broken.append(f"{path.relative_to(PACKAGE)}:{line} imports {imported}")
    assert not broken, "\n".join(broken)


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in MODULES if (n := len(_source(p).splitlines())) > 600}
    assert not long


def _string_constants(path: pathlib.Path, text: str) -> list[int]:
    docstrings = {
        id(n.body[0].value)
        for n in _nodes(path)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }
    return [n.lineno for n in _nodes(path)
            if isinstance(n, ast.Constant) and n.value == text and id(n) not in docstrings]


@pytest.mark.parametrize("literal, most", [("ai.onnx", 2), ("com.microsoft", 1)])
def test_each_domain_is_spelled_out_once(literal, most):
    places = [f"{p.relative_to(PACKAGE)}:{line}" for p in MODULES for line in _string_constants(p, literal)]
    assert len(places) <= most, places


def test_start_up_loads_nothing_heavy():
    code = (
        "import sys, opfuse.cli; opfuse.cli.build_parser();"
        "print(sorted(m for m in ('onnx', 'onnx_ir', 'numpy', 'onnxruntime', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_registry_and_the_pass_classes_agree():
    for name in REGISTRY:
        cls = pass_class(name)
        assert issubclass(cls, OpfusePass) and cls.name == name
    assert {n for n in REGISTRY if pass_class(n).emits_contrib_ops} == {"fuse-activation", "fuse-epilogue",
                                                                       "fuse-dynamic-int8"}


def test_every_targets_kernels_are_rows_of_the_op_table():
    from opfuse.targets import TARGETS
    from opfuse.targets.kernels import load_target

    for name in TARGETS:
        target = load_target(name)
        assert target.name == name
        for anchor, kernel in target.kernels.items():
            assert kernel.anchor == anchor and OP_KINDS[anchor] is OpKind.OUT_ELEMWISE_FUSABLE
            assert kernel.activations <= ACTIVATION_OPS, (name, kernel.activations - ACTIVATION_OPS)
    assert all(OP_KINDS[op] in ELEMENTWISE_KINDS for op in ACTIVATION_OPS)


def test_every_function_local_import_says_why():
    """Heavy modules are imported by the modules that need them; one left inside a function
    carries a comment on its line (or the line before) saying why it is there."""
    silent = []
    for path in MODULES:
        lines = _source(path).splitlines()
        for fn in _nodes(path):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    here, before = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                    if "#" not in here and not before.startswith("#"):
                        silent.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {here.strip()}")
    assert not silent, "\n".join(sorted(set(silent)))


def test_the_accelerator_model_reads_fused_kernels_through_their_target():
    """The FusedConv encoding is decoded in one place, the module that emits it."""
    for path in MODULES:
        if path.name == "onnxruntime.py":
            continue
        text = _source(path)
        assert '"activation_params"' not in text and "'activation_params'" not in text, path


def test_the_torch_wing_names_activations_in_the_onnx_vocabulary():
    from opfuse.torch.rules import ACTIVATIONS, TORCH_ONLY_ACTIVATIONS

    names = {name for name, _ in ACTIVATIONS.values()}
    assert names - TORCH_ONLY_ACTIVATIONS <= ACTIVATION_OPS
    assert not TORCH_ONLY_ACTIVATIONS & ACTIVATION_OPS  # declared torch-only: truly not ONNX ops


def test_fresh_names_take_constant_time_per_name():
    """A name table hands out base_1, base_2, ... without retrying the ones it gave
    (counted membership tests, not a timing: 16000 unnamed blocks once took minutes)."""
    import onnx_ir as ir

    from opfuse.core.analysis import NameTable

    class Counting(set):
        lookups = 0

        def __contains__(self, item):
            Counting.lookups += 1
            return super().__contains__(item)

    table = NameTable(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10))
    table._taken = Counting({"w_3"})  # one name the model already has
    names = [table.fresh("w") for _ in range(20000)]
    assert len(set(names)) == 20000 and names[:4] == ["w", "w_1", "w_2", "w_4"]
    assert Counting.lookups <= 2 * 20000 + 1


# -- one place per op fact ---------------------------------------------------------------------

# Collections of op names outside the op table (opfuse/core/ops.py) and the target modules
# (whose lists are what each target runs). Each is a rule of its own module, not a fact about
# the ops; a new one must be added here with the reason it is not a column of the op table.
OWN_RULES = {
    ("llm/__init__.py", frozenset({"Gather", "MatMul"})): "the ops int4 weight-only quantisation rewrites (its report)",
    ("llm/quantize_int4.py", frozenset({"Gather", "MatMul"})): "the ops int4 weight-only quantisation rewrites",
    ("llm/gqa.py", "_REPEAT"): "the ops between the cache and the attention's MatMuls it looks through (repeat_kv, scale)",
    ("passes/patterns/self_attention.py", "_SCALINGS"): "the two ways an export scales the scores (its rules)",
    ("passes/reshape_dims.py", "_SHAPE_ARITHMETIC"): "the shape arithmetic a constant target leaves dead",
    ("passes/mask_fill.py", "_PASS_THROUGH"): "the ops through which a mask reaches attn_mask unchanged (its legality)",
    ("passes/rotary_table.py", "PATH_OPS"): "the ops a position-wise path of angles may hold (the pass's legality)",
    ("passes/index_arithmetic.py", "_BROADCASTS"): "the ops an export of broadcast_tensors writes (rule 1)",
    ("passes/index_arithmetic.py", "_IDENTITY_CONSTANT"): "the ops that return their input with a constant (rule 4)",
    ("core/activations.py", frozenset({"Relu", "Clip"})): "the clamp-merging rule",
    ("bench/table.py", frozenset({"BatchNormalization", "Relu", "Clip", "Add"})): "columns the table shows",
    ("passes/equalize.py", "BETWEEN"): "how each op commutes with a channel scale (the pass's algebra)",
    ("passes/equalize.py", "_NOT_HANDLED"): "reasons for ops the pass does not look through",
    ("passes/fold_arithmetic.py", frozenset({"Add", "Sub", "Mul", "Div", "Neg"})): "the consumers whose algebra it folds",
    ("passes/layout_chain.py", "AXIS_MAPS"): "the layout ops whose axis algebra it implements, one function each",
    ("passes/fuse_patterns.py", "_PLUMBING"): "ops a rule writes around the op it fuses, which a record looks past",
    ("quantization/presets.py", "CPU_OPS"): "what a preset quantises (a policy)",
    ("quantization/algorithms/bias_correction.py", frozenset({"Conv", "Gemm"})): "the layers its correction supports",
    ("quantization/qdq/quantizer.py", frozenset({"Conv", "Gemm"})): "the layers that get a zero bias to correct",
    ("quantization/qdq/layers.py", frozenset({"Relu", "Clip"})): "ops ONNX Runtime's quantiser folds into a range",
    ("quantization/qdq/sqnr.py", "CHANNEL_FIRST"): "ops measured per channel on axis 1",
    ("quantization/interpreter/ops.py", "_REDUCTIONS"): "the reductions its torch interpreter implements",
    ("verify/inputs.py", "*"): "how generated inputs follow their consumers",
    ("verify/reference.py", "PERMUTATIONS"): "the ops that keep every element of a constant and add none "
                                             "(its magnitude is the constant's)",
    ("verify/variation.py", "MOVES"): "the ops that only move or select a weight's elements (a Cast commutes with them)",
    ("passes/leftovers.py", "PATTERN_PRIMITIVES"): "which pattern a primitive left over belongs to (for its note)",
    ("torch/fuse.py", frozenset({"Conv", "ConvTranspose"})): "the torch wing's producer kinds",
    ("targets/ethos_u/tflite_norm.py", "QUANTISED_OPS"): "the ops ONNX Runtime's quantiser is told to quantise "
                                                         "beyond its registries (the target's policy)",
    ("targets/ethos_u/tflite_attention.py", "LAYOUT_AWARE"): "the ops whose lowering reads a rank-4 input in any "
                                                             "layout (its rule)",
}
TARGET_MODULES = {"targets/onnxruntime.py", "targets/onnx.py", "targets/qnn/__init__.py",
                  "targets/ethos_u/lower.py", "targets/ethos_u/tflite_ops.py"}


def _op_name_collections(path: pathlib.Path):
    """(line, assigned name or None, op names) of every literal collection of >= 2 op names."""
    from opfuse.core.ops import OPS

    names_of = {}
    for node in _nodes(path):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for sub in ast.walk(node.value) if node.value is not None else ():
                for t in targets:
                    if isinstance(t, ast.Name):
                        names_of.setdefault(id(sub), t.id)
    for node in _nodes(path):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]
        else:
            continue
        strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(strings) >= 2 and len(strings) == len(elts) and all(s in OPS for s in strings):
            yield node.lineno, names_of.get(id(node)), frozenset(strings)


def test_the_op_table_is_the_only_place_op_facts_are_spelled():
    """Weighted ops, activations, kinds, commutativity, int8 roles: read from the op table.
    A module that lists op names of its own fails here, unless the list is its own rule."""
    stray = []
    for path in MODULES:
        rel = str(path.relative_to(PACKAGE))
        if rel == "core/ops.py" or rel in TARGET_MODULES:
            continue
        for line, name, ops in _op_name_collections(path):
            if (rel, ops) in OWN_RULES or (rel, name) in OWN_RULES or (rel, "*") in OWN_RULES:
                continue
            stray.append(f"{rel}:{line} {name or ''} {sorted(ops)}")
    assert not stray, "\n".join(stray)


def test_the_float_dtypes_are_spelled_once():
    """The set of float dtypes is vocabulary.FLOAT_DTYPES; a module may name the subset it
    supports (a policy), not keep its own copy of the whole set."""
    stray = []
    for path in MODULES:
        rel = str(path.relative_to(PACKAGE))
        if rel == "core/ops.py":
            continue
        for node in _nodes(path):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                found = {e.value for e in node.elts if isinstance(e, ast.Constant)} & {"float16", "bfloat16",
                                                                                         "float32", "float64"}
                if len(found) == 4:
                    stray.append(f"{rel}:{node.lineno} {sorted(found)}")
    assert not stray, "\n".join(stray)


# Experiments measured and left (experiments/*/NOTES.md) live outside the package: no switch
# that turns one back on, and no lab notes (dates, stop numbers, paths outside the repository).
LEFT_SWITCHES = {"KEEP_KERNEL_SUMS", "DROP", "ATTENTION"}
LAB_NOTES = {
    "a date": re.compile(r"20\d\d-\d\d-\d\d"),
    "a stop number": re.compile(r"\bstop \d+", re.IGNORECASE),
    "a path outside the repository": re.compile(r"/work/|\.\./shared"),
}


def test_no_experiment_switch_is_left_in_the_package():
    found = []
    for path in MODULES:
        for node in _tree(path).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id in LEFT_SWITCHES]
    assert not found, "\n".join(found)
    # the activation scales' fit: learned or searched; "fixed" (the rounding alone) was left
    tree = _tree(PACKAGE / "quantization" / "algorithms" / "reconstruction.py")
    fits = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "SCALE_FITS" for t in n.targets)]
    assert fits == [("learned", "search")]


def test_no_lab_note_in_the_package():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {what}: {line.strip()[:80]}"
             for path in sorted(p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for what, pattern in LAB_NOTES.items() if pattern.search(line)]
    assert not found, "\n".join(found)


# What a run measured, in a docstring or a comment: it belongs in docs/results/ with its command
# (docs/results/measurements.md), the docstring says why the code does what it does.
MEASUREMENTS = {
    "a time": re.compile(r"\b\d+(\.\d+)?\s(ms|us|µs|s|min|minutes|seconds|hours?)\b(?![-\w])"),
    "an SQNR": re.compile(r"\d+(\.\d+)?\s?dB\b"),
    "a speed ratio": re.compile(r"\b\d+(\.\d+)?(-\d+(\.\d+)?)?x\b(?![-\w])"),
}


def _docstrings_and_comments(path: pathlib.Path):
    """(line number, text) of every docstring line and comment of a module."""
    source = _source(path)
    for node in _nodes(path):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            for offset, line in enumerate(node.body[0].value.value.splitlines()):
                yield node.body[0].lineno + offset, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def test_no_measurement_in_a_docstring():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {what}: {line.strip()[:80]}"
             for path in MODULES for number, line in _docstrings_and_comments(path)
             for what, pattern in MEASUREMENTS.items() if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_measurement_check_sees_what_it_must():
    said = ["took 44 s for 16000 blocks", "0.414 ms with the Ifs", "CPU 19.1 -> 22.0 dB", "read 9.85 dB at 0.76x",
            "measured, it took 7-10x the estimate", "151 us against 118 us", "~100 us each"]
    unsaid = ["leading 1s up to the rank", "a 2x2 window", "int8 x int8 -> int32", "the 16-bit activations"]
    assert all(any(p.search(s) for p in MEASUREMENTS.values()) for s in said)
    assert not any(p.search(s) for s in unsaid for p in MEASUREMENTS.values())


def test_the_architecture_page_names_every_module():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(PACKAGE.parent)) for p in MODULES
               if f"`{p.relative_to(PACKAGE.parent).as_posix()}`" not in page]
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)


# -- the layout: load -> analyse -> rewrite -> verify -> save and report ---------------------------

# the package root: the pipeline's steps and its front door; everything else sits in the folder of
# its stage (core, prepare, passes, verify, targets, cost, quantization, bench, torch, models)
ROOT_MODULES = {"__init__", "__main__", "cli", "errors", "pipeline", "load", "save", "report", "runtime"}
# package -> the opfuse packages and modules its modules may import (module-level and local)
MAY_IMPORT = {
    "opfuse.core": ("opfuse.core", "opfuse.errors", "opfuse.report"),
    "opfuse.prepare": ("opfuse.core", "opfuse.prepare", "opfuse.errors", "opfuse.report"),
    "opfuse.cost": ("opfuse.core", "opfuse.cost", "opfuse.errors", "opfuse.report", "opfuse.targets.kernels"),
}


def _opfuse_imports(path: pathlib.Path) -> set[str]:
    """The opfuse modules ``path`` imports (a name imported from a package counts as its module
    when there is one)."""
    found = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _in(a.name, "opfuse")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _in(node.module, "opfuse"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in _MODULE_NAMES else node.module
                      for a in node.names}
    return found


_MODULE_NAMES = {_module_name(p) for p in MODULES}


def test_the_package_root_holds_the_pipeline_steps_only():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, sorted(root ^ ROOT_MODULES)


def test_each_stage_imports_only_what_comes_before_it():
    broken = []
    for path in MODULES:
        name = _module_name(path)
        for package, allowed in MAY_IMPORT.items():
            if _in(name, package):
                broken += [f"{name} imports {m}" for m in sorted(_opfuse_imports(path)) if not _in(m, *allowed)]
    assert not broken, "\n".join(broken)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found



def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    """Tarjan's strongly connected components over every import between opfuse's modules
    (function-local ones too): a cycle is a component of more than one module."""
    graph = {_module_name(p): {m for m in _opfuse_imports(p) if m in _MODULE_NAMES and m != _module_name(p)}
             for p in MODULES}
    assert not _cycles(graph), _cycles(graph)
