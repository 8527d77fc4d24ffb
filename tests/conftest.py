"""pytest fixtures. The helpers for building and running graphs are in ``graphs.py``.

``quantize``'s default (``reconstruct="auto"``) runs block reconstruction, which takes seconds
on the graphs built here and minutes on the built-in models: a test of another step asks for
``reconstruct=False`` (``--reconstruct off``) in its own call, and the tests of reconstruction
set ``reconstruction_budget_s`` and ``reconstruction_iterations`` where they need to.

``optimize``'s measured fusion choice (``tune``, :mod:`opfuse.tune`) times every fusion family on
ONNX Runtime: seconds per model, and on a shared machine a decision that is noise. The suite runs
with ``OPFUSE_TUNE=off`` in the environment (set here, so the CLI run in a subprocess sees it too):
every test follows the target's default policy, as ``--no-tune`` does, and the tests of tuning
(``test_tune.py``) ask for ``tune=True`` in their own calls, with a deterministic clock. Tuning
records are cached in a folder of each test's own (``OPFUSE_CACHE_DIR``, :func:`_own_tuning_cache`).

The suite's temporary directory (``TMPDIR``, set here so the CLI run in a subprocess uses it
too) is a fresh one per session: what opfuse leaves in it is found at the end, and fails the
session (:func:`pytest_sessionfinish`); the directory, pytest's own ``tmp_path`` folders inside
it included, is then removed (``--basetemp DIR`` keeps those elsewhere).

Hypothesis runs under a profile (:mod:`profiles`): ``fast`` by default (no shrinking),
``shrink`` with ``HYPOTHESIS_PROFILE=shrink``, ``ci`` where ``CI`` is set, and ``thorough``
(``--hypothesis-profile thorough``: the full count of the tests that draw hundreds of examples).

A test that needs an extra's package carries ``extras.needs(module)`` (the ``needs_extra`` mark,
checked here) or calls ``extras.require(module)``: a skip, or a failure when the run declares
the extra installed (:mod:`extras`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import onnx
import pytest

import decoder_nets
import extras
import profiles

os.environ["OPFUSE_TUNE"] = "off"


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path_factory, monkeypatch):
    """Each test its own tuning cache: a record one test's clock wrote is never another's replay."""
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("tuning-cache")))


# a pytest-xdist worker inherits the TMPDIR of the run that started it, which checks it at its end
SESSION_TMP = None if "PYTEST_XDIST_WORKER" in os.environ else pathlib.Path(tempfile.mkdtemp(prefix="opfuse-tests-"))
# the suite's own exports, made once a session and shared by its workers (decoder_nets.shared_export)
EXPORTS = "tests-exports"
if SESSION_TMP is not None:
    os.environ["TMPDIR"] = str(SESSION_TMP)
    os.environ[decoder_nets.EXPORTS_ENV] = str(SESSION_TMP / EXPORTS)
    tempfile.tempdir = None  # (tempfile caches its choice: chosen again from TMPDIR)


profiles.register()


@pytest.fixture
def tmp_model(tmp_path):
    """Save a ModelProto under tmp_path and return its path."""

    def save(m: onnx.ModelProto, name: str = "model.onnx"):
        path = tmp_path / name
        onnx.save(m, path)
        return path

    return save


# Run on pytest-xdist workers (``make test``: two on two cores), each worker's numpy, torch and
# OpenMP run on one thread: else each library starts a thread per core in each worker, and the
# workers' pools fight over the cores (a test of AdaRound took ten times its time alone). Set in
# the run that starts the workers, which inherit it; a value already in the environment stays.
WORKER_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# The files that cost the most, the longest first (docs/results/test_time.md has the measured seconds). Under
# ``--dist loadfile`` pytest-xdist hands the next file to whichever worker is free, in the order of
# the collection; run first, the long files leave the short ones to fill in at the end and the two
# workers finish together (longest first), where one long file collected last would run alone while
# the other worker waits. The other files keep their order after these.
LONGEST_FIRST = ("test_rotary.py", "test_llm.py", "test_transformers.py", "test_mask_fill.py", "test_bench.py",
                 "test_reconstruction.py", "test_present_window.py", "test_supervise.py", "test_qnn_llm_quantize.py",
                 "test_rotary_interleaved.py", "test_gqa.py", "test_ethos_u_lower.py", "test_rotary_table.py",
                 "test_written.py", "test_readme.py", "test_quantize.py", "test_llm_int4.py",
                 "test_padded_verification.py", "test_pattern_adapter.py", "test_llm_gguf_load.py",
                 "test_fold_properties.py", "test_computed_args.py", "test_decoders_tolerance.py", "test_cli.py",
                 "test_torch_fuse.py", "test_qnn_target.py", "test_models.py", "test_tune.py",
                 "test_index_arithmetic.py", "test_layout.py")


def _one_runtime_thread() -> None:
    """Where the run asks for one thread (:data:`WORKER_THREADS`), ONNX Runtime's sessions that do not
    set their own thread count get one too: its thread pool is its own (not OpenMP's, so the variables
    above do not reach it), a thread per core in each session, spinning while it waits for work.
    The sessions ONNX Runtime's quantiser, the tests and the libraries make with the default options
    would otherwise fight the other worker for the cores, as the numpy and torch pools did. A session
    that sets a count (opfuse.runtime's, when asked) keeps it."""
    if os.environ.get("OMP_NUM_THREADS") != "1":
        return
    try:
        import onnxruntime as ort
    except ImportError:
        return
    init = ort.InferenceSession.__init__
    if getattr(init, "one_thread", False):
        return

    def one_thread(self, path_or_bytes, sess_options=None, *args, **kwargs):
        if sess_options is None:
            sess_options = ort.SessionOptions()
        if sess_options.intra_op_num_threads == 0:
            sess_options.intra_op_num_threads = 1
        init(self, path_or_bytes, sess_options, *args, **kwargs)

    one_thread.one_thread = True
    ort.InferenceSession.__init__ = one_thread


_one_runtime_thread()


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_extra(*modules): the test needs these modules of an extra (tests/extras.py)")
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        for name in WORKER_THREADS:
            os.environ.setdefault(name, "1")
    if hasattr(config.option, "loadscopereorder"):  # (xdist's own order is by test count: LONGEST_FIRST's instead)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: a file's own order kept)


def pytest_runtest_setup(item):
    extras.check_marks(item)


# what a library keeps in the temporary directory on purpose, across runs (not opfuse's):
# ".ses" is ONNX Runtime's telemetry session file (its first-launch time and an id; the strings
# "sessionfirstlaunchtime", ".ses" of onnxruntime_pybind11_state.so); "torchinductor_<user>" is
# torch's compile cache, which its dynamo exporter creates (the tests that export with torch)
NOT_OPFUSES = (".ses", "torchinductor_")


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when opfuse left anything in the temporary directory; then remove it.
    pytest's own folders (``pytest-of-*``), the suite's exports (:data:`EXPORTS`) and :data:`NOT_OPFUSES`
    are not opfuse's. (A
    pytest-xdist worker checks nothing: the run that started the workers checks after them.)"""
    if SESSION_TMP is None:
        return
    left = sorted(p.name for p in SESSION_TMP.iterdir()
                  if not p.name.startswith(("pytest-of-", EXPORTS, *NOT_OPFUSES))) if SESSION_TMP.exists() else []
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"temporary files left by the tests in {SESSION_TMP}: {', '.join(left[:20])}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
