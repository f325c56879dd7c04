"""scripts/gpu_tests.py (run by scripts/device_gpu_tests.sh on the GPU machine): the junit XML
-> JSON converter on a fixed sample and on real pytest output, the report's schema from a run
here, the commit named from the device's fingerprints, and the GPU test list complete (every
test file that names CUDA is listed as GPU or CPU-only)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_tests  # noqa: E402

SAMPLE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="2" tests="8" time="3.2">
<testcase classname="tests.test_kern" name="test_ok[1.5-a/b]" time="0.120" />
<testcase classname="tests.test_kern" name="test_bad" time="1.5">
  <failure message="AssertionError: relative error 3e-1 &gt;= 2e-3">trace</failure></testcase>
<testcase classname="tests.test_kern" name="test_setup_err" time="0.0">
  <error message="failed on setup with &quot;RuntimeError: CUDA&quot;">trace</error></testcase>
<testcase classname="tests.test_kern" name="test_skip" time="0.001">
  <skipped type="pytest.skip" message="needs a CUDA GPU">skip</skipped></testcase>
<testcase classname="tests.test_kern" name="test_xf" time="0.2">
  <skipped type="pytest.xfail" message="known" /></testcase>
<testcase classname="tests.test_kern.TestGroup" name="test_in_class" time="0.3" />
<testcase classname="tests.test_kern" name="test_teardown" time="0.4">
  <failure message="assert 1 == 2">t</failure></testcase>
<testcase classname="tests.test_kern" name="test_teardown" time="0.1">
  <error message="failed on teardown">t</error></testcase>
<testcase classname="" name="tests.test_broken" time="0.0">
  <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>"""

EXPECTED = [
    {"nodeid": "tests/test_kern.py::test_ok[1.5-a/b]", "outcome": "passed", "duration": 0.12},
    {"nodeid": "tests/test_kern.py::test_bad", "outcome": "failed", "duration": 1.5,
     "message": "AssertionError: relative error 3e-1 >= 2e-3"},
    {"nodeid": "tests/test_kern.py::test_setup_err", "outcome": "error", "duration": 0.0,
     "message": 'failed on setup with "RuntimeError: CUDA"'},
    {"nodeid": "tests/test_kern.py::test_skip", "outcome": "skipped", "duration": 0.001,
     "message": "needs a CUDA GPU"},
    {"nodeid": "tests/test_kern.py::test_xf", "outcome": "xfailed", "duration": 0.2,
     "message": "known"},
    {"nodeid": "tests/test_kern.py::TestGroup::test_in_class", "outcome": "passed",
     "duration": 0.3},
    {"nodeid": "tests/test_kern.py::test_teardown", "outcome": "failed", "duration": 0.4,
     "message": "assert 1 == 2"},
    {"nodeid": "tests/test_broken.py", "outcome": "error", "duration": 0.0,
     "message": "collection failure"},
]


def test_sample_junit_converts():
    tests = gpu_tests.junit_to_tests(SAMPLE)
    assert tests == EXPECTED
    assert gpu_tests.summarize(tests) == {"passed": 2, "failed": 2, "error": 2, "skipped": 1,
                                          "xfailed": 1, "total": 8}


def test_table_names_what_did_not_pass():
    tests = gpu_tests.junit_to_tests(SAMPLE)
    report = {"tests": tests, "summary": gpu_tests.summarize(tests), "seconds": 3.2,
              "gpu": "NVIDIA H200", "ok": False, "not_run": {"tests/test_x.py": "no SGLang"}}
    text = gpu_tests.table(report)
    assert "tests/test_kern.py" in text and "tests/test_x.py    " in text
    assert "NOT RUN: no SGLang" in text
    assert "FAILED  tests/test_kern.py::test_bad: AssertionError" in text
    assert "SKIPPED tests/test_kern.py::test_skip: needs a CUDA GPU" in text
    assert text.splitlines()[-1].startswith("2 passed, 2 failed, 2 errors, 1 skipped")
    assert text.endswith("on NVIDIA H200; NOT OK")


def test_real_pytest_junit_converts(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_param(x):\n    assert x < 2\n"
        "def test_skip():\n    pytest.skip('no GPU here')\n"
        "@pytest.mark.xfail(reason='known')\n"
        "def test_xfail():\n    assert 0\n"
        "class TestC:\n    def test_m(self):\n        pass\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n"
        "def test_err(broken):\n    pass\n")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "--rootdir", str(tmp_path), "test_sample.py"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120)
    got = {t["nodeid"]: t for t in gpu_tests.junit_to_tests(xml.read_text())}
    assert {k: t["outcome"] for k, t in got.items()} == {
        "test_sample.py::test_param[1]": "passed", "test_sample.py::test_param[2]": "failed",
        "test_sample.py::test_skip": "skipped", "test_sample.py::test_xfail": "xfailed",
        "test_sample.py::TestC::test_m": "passed", "test_sample.py::test_err": "error"}
    assert "assert 2 < 2" in got["test_sample.py::test_param[2]"]["message"]
    assert got["test_sample.py::test_skip"]["message"].endswith("no GPU here")
    assert all(isinstance(t["duration"], float) and t["duration"] >= 0 for t in got.values())


@pytest.mark.slow
def test_run_writes_the_report(tmp_path):
    """The device's path end to end, on this machine's CPU: one quick test file."""
    out = tmp_path / "gpu-tests.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_tests.py"), "run",
                           "--out", str(out), "--jobs", "1", "--files",
                           "tests/test_row_merge_kernel.py", "--", "-k", "rows_per_req0"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == gpu_tests.SCHEMA and report["ok"] is True
    for key in ("commit", "kernels_commit", "dirty", "gpu", "torch", "triton", "date_utc",
                "summary", "tests", "fingerprints", "not_run", "groups"):
        assert key in report, key
    assert re.fullmatch(r"[0-9a-f]{40}", report["commit"])  # git is there on this machine
    assert report["summary"]["passed"] == report["summary"]["total"] >= 2
    assert all(t["nodeid"].startswith("tests/test_row_merge_kernel.py::test_") and
               t["outcome"] == "passed" for t in report["tests"])
    assert report["fingerprints"]["triton_kernels/row_merge.py"] == \
        gpu_tests.blob_id((REPO / "triton_kernels/row_merge.py").read_bytes())
    assert "passed" in proc.stdout and out.with_suffix(".log").exists()


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def test_record_names_the_commit_from_fingerprints(tmp_path):
    root = tmp_path
    _git(root, "init", "-q")
    (root / "triton_kernels").mkdir()
    (root / "tests").mkdir()
    kern, test = root / "triton_kernels" / "k.py", root / "tests" / "test_k.py"
    kern.write_text("v1\n")
    test.write_text("t1\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "c1")
    kern.write_text("v2\n")
    _git(root, "commit", "-q", "-am", "c2")
    c2 = _git(root, "rev-parse", "HEAD")
    test.write_text("t2\n")
    _git(root, "commit", "-q", "-am", "c3")
    c3 = _git(root, "rev-parse", "HEAD")
    prints = gpu_tests.fingerprints(root)
    assert prints["triton_kernels/k.py"] == _git(root, "hash-object", str(kern))
    got = gpu_tests.identify(root, prints)
    assert (got["commit"], got["kernels_commit"], got["dirty"]) == (c3, c2, False)
    assert not got["kernels_dirty"] and got["dirty_paths"] == []
    # the device ran c2's files: that commit is named, not HEAD
    old = dict(prints, **{"tests/test_k.py": gpu_tests.blob_id(b"t1\n")})
    got = gpu_tests.identify(root, old)
    assert (got["commit"], got["kernels_commit"], got["dirty"]) == (c2, c2, False)
    # an uncommitted kernel change and an untracked file: HEAD, dirty, both named
    dirty = dict(prints, **{"triton_kernels/k.py": gpu_tests.blob_id(b"v3\n"),
                            "tests/test_new.py": gpu_tests.blob_id(b"x\n")})
    got = gpu_tests.identify(root, dirty)
    assert got["commit"] == c3 and got["dirty"] is True and got["kernels_dirty"] is True
    assert got["dirty_paths"] == ["tests/test_new.py", "triton_kernels/k.py"]


def test_every_test_file_naming_cuda_is_listed():
    names = re.compile(gpu_tests.NAMES_CUDA)
    naming = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
              if names.search(p.read_text())}
    listed = set(gpu_tests.GPU_TEST_FILES) | set(gpu_tests.CPU_ONLY)
    assert not naming - listed, (f"test files naming CUDA in neither GPU_TEST_FILES nor "
                                 f"CPU_ONLY of scripts/gpu_tests.py: {sorted(naming - listed)}")
    assert all((REPO / f).is_file() for f in listed), sorted(f for f in listed
                                                             if not (REPO / f).is_file())
    assert not set(gpu_tests.GPU_TEST_FILES) & set(gpu_tests.CPU_ONLY)
    assert gpu_tests.NEEDS_SGLANG <= set(gpu_tests.GPU_TEST_FILES)
    # every `gpu`-marked test is in a listed GPU file
    gpu_mark = re.compile(r"pytest\.mark\.gpu\b")
    marked = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
              if gpu_mark.search(p.read_text())}
    assert len(marked) >= 4, sorted(marked)
    assert marked <= set(gpu_tests.GPU_TEST_FILES), sorted(marked - set(gpu_tests.GPU_TEST_FILES))


@pytest.mark.slow
def test_files_that_import_sglang_are_marked_so():
    """Imported with SGLang absent (as on the device without the server bundle), the GPU test
    modules that fail are all in NEEDS_SGLANG (reported as not run there, not as errors)."""
    code = ("import importlib, json, sys\nsys.modules['sglang'] = None\n"
            "sys.path.insert(0, 'tests')\nfailed = []\n"
            "for f in json.loads(sys.argv[1]):\n"
            "    try:\n        importlib.import_module(f[6:-3])\n"
            "    except ImportError:\n        failed.append(f)\n"
            "print(json.dumps(failed))\n")
    proc = subprocess.run([sys.executable, "-c", code,
                           json.dumps(sorted(gpu_tests.GPU_TEST_FILES))], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = set(json.loads(proc.stdout.splitlines()[-1]))
    assert failed, "no GPU test module needs SGLang? (the check would then prove nothing)"
    assert failed <= gpu_tests.NEEDS_SGLANG, sorted(failed - gpu_tests.NEEDS_SGLANG)


def test_device_script_parses():
    proc = subprocess.run(["bash", "-n", str(REPO / "scripts" / "device_gpu_tests.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_record_refuses_a_report_recorded_already(tmp_path):
    """The repo's own benchmarks/results/gpu-tests.json copied back from a device call (it has no
    fingerprints: `record` drops them) is named as such, not a KeyError."""
    recorded = tmp_path / "gpu-tests.json"
    recorded.write_text(json.dumps({"schema": gpu_tests.SCHEMA, "commit": "de714a5",
                                    "recorded_utc": "2026-12-05T05:44:53+00:00"}))
    with pytest.raises(SystemExit, match="a report recorded already .de714a5"):
        gpu_tests.main(["record", str(recorded), "--out", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
