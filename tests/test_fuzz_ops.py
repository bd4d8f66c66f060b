"""Crash safety of the sparse24 ops under hypothesis fuzzing: good, bad, corrupt, huge, empty input.

The properties live in tests/helpers/op_fuzz_worker.py and run in a child process: a segfault or
abort inside a kernel kills the child, not pytest, and is reported here as a failure with the
property that was running. Every property checks answers against the numpy format reference or
float64 numpy, and that bad input raises a clear Python exception.
"""

import pytest

from helpers import procs

PROPERTIES = [
    "compress_matches_reference_or_names_the_group",
    "compress_rejects_bad_shapes_and_dtypes",
    "decompress_corrupted_inputs_raise_or_match_reference",
    "matmul_matches_float64_and_propagates_specials",
    "matmul_rejects_inconsistent_inputs",
    "high_level_compress_any_rank",
    "huge_and_empty_shapes",
]


@pytest.mark.slow
def test_op_fuzz_in_subprocess(tmp_path):
    result = procs.run(
        "op_fuzz_worker.py",
        *PROPERTIES,
        tmp=tmp_path,
        timeout=400,
        env=procs.worker_env(HYPOTHESIS_EXAMPLES="30", TF_CPP_MIN_LOG_LEVEL="3"),
    )
    result.check()
    for name in PROPERTIES:
        assert f"[op-fuzz] {name}: ok" in result.output, (
            f"{name} did not report ok:\n{result.tail()}"
        )


@pytest.mark.parametrize(
    "mode, reason", [("segv", "SIGSEGV"), ("abort", "SIGABRT"), ("hang", "time limit")]
)
def test_harness_turns_crashes_and_hangs_into_failures(tmp_path, mode, reason):
    result = procs.run("crash_worker.py", mode, tmp=tmp_path, timeout=3)
    with pytest.raises(AssertionError, match=reason):
        result.check()
    assert f"crash_worker: {mode}" in result.output
