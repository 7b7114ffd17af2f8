"""The suite's pytest-xdist scheduler (`tests/crash_retry.py`) when a worker dies: the run ends, the crashed test
runs once more, and a test that crashes every time fails the run.

Each test runs pytest on a small generated suite in a child process (no jax), with a time limit: pytest-xdist
3.8's own `--dist loadfile` scheduler hangs on the first case."""
import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))


def _run_suite(tmp_path, files, workers):
    """Run `pytest -n workers --dist loadfile -p crash_retry` on `files` (name -> source) in `tmp_path`; returns
    (exit code, output)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, source in files.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_", "JAX_"))}
    env["PYTHONPATH"] = TESTS
    env["CRASH_MARKER"] = str(tmp_path / "crashed-once")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadfile", "-p", "crash_retry",
         "-p", "no:cacheprovider", "-p", "no:benchmark"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


PASSING = {
    "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    "test_b.py": "def test_b1(): pass\ndef test_b2(): pass\ndef test_b3(): pass\n",
}


def test_a_test_that_crashes_once_is_rerun_and_the_run_passes(tmp_path):
    """One worker: it finishes two files, then dies in the last file's only test. pytest-xdist 3.8 requeues the
    finished files as empty work units and hangs; here the test reruns on the replacement worker and passes."""
    crash_once = """
        import os, pathlib
        def test_crash_once():
            marker = pathlib.Path(os.environ["CRASH_MARKER"])
            if not marker.exists():
                marker.touch()
                os.abort()
    """
    code, out = _run_suite(tmp_path, {**PASSING, "test_c.py": crash_once}, workers=1)
    assert code == 0, out
    assert "crashed while running 'test_c.py::test_crash_once'" in out, out
    assert "7 passed, 1 rerun" in out, out


def test_a_test_that_always_crashes_fails_and_the_rest_still_run(tmp_path):
    """Two workers: a test that aborts its worker every time is rerun once, then reported failed; the test after
    it in the same file and every other file still run."""
    crash_always = "import os\ndef test_crash_always(): os.abort()\ndef test_after(): pass\n"
    code, out = _run_suite(tmp_path, {**PASSING, "test_c.py": crash_always}, workers=2)
    assert code == 1, out
    assert "FAILED test_c.py::test_crash_always" in out, out
    assert "1 failed, 7 passed, 1 rerun" in out, out
