"""The CPU fused row-wise Adagrad choice (``dtrec.ops.backends.cpu_choice``): both
implementations time and serve the same lookup with the same result, the environment
override wins, bad values are errors, and the choice switches what ``"auto"`` runs."""

from __future__ import annotations

import pytest
import torch

from dtrec.ops.backends.fbgemm_loader import fbgemm_ops
from dtrec.ops.backends.registry import cpu_fused_rules
from dtrec.optim import cpu_choice


@pytest.fixture
def restore_choice():
    before = cpu_fused_rules()
    yield
    from dtrec.ops.backends.registry import set_cpu_fused_rules

    set_cpu_fused_rules(before)


@pytest.mark.skipif(fbgemm_ops() is None, reason="fbgemm_gpu does not load")
def test_both_implementations_time() -> None:
    times = cpu_choice._time_both(repeats=1)
    assert set(times) == {"fbgemm", "torch"} and all(t > 0 for t in times.values())


def test_environment_overrides_the_timing(monkeypatch) -> None:
    monkeypatch.setenv(cpu_choice.ENV, "torch")
    assert cpu_choice.preferred_cpu_rowwise_adagrad() == "torch"
    monkeypatch.setenv(cpu_choice.ENV, "fbgemm")
    assert cpu_choice.preferred_cpu_rowwise_adagrad() == "fbgemm"
    monkeypatch.setenv(cpu_choice.ENV, "fast")
    with pytest.raises(ValueError, match="DTREC_CPU_ROWWISE_ADAGRAD"):
        cpu_choice.preferred_cpu_rowwise_adagrad()


@pytest.mark.skipif(fbgemm_ops() is None, reason="fbgemm_gpu does not load")
def test_choice_switches_what_auto_runs(restore_choice) -> None:
    """The same backward + step through ``"auto"`` with each choice: which code ran is
    seen by counting fbgemm's op, and the results agree to float reassociation."""
    import dtrec
    from dtrec.ops.lookup import Lookup, packed_views
    from dtrec.optim import RowWiseAdagrad

    def run(choice: str) -> tuple[list[torch.Tensor], int]:
        cpu_choice.use_cpu_rowwise_adagrad(choice)
        assert cpu_choice.cpu_rowwise_adagrad() == choice
        gen = torch.Generator().manual_seed(0)
        weights = packed_views([(50, 8), (30, 8)], torch.float32, torch.device("cpu"))
        for w in weights:
            w.copy_(torch.randn(w.shape, generator=gen))
        sums = packed_views([(50,), (30,)], torch.float32, torch.device("cpu"), zero=True)
        values = torch.cat([torch.randint(0, 50, (40,), generator=gen),
                            torch.randint(0, 30, (40,), generator=gen)])  # fmt: skip
        lookup = Lookup(weights, [0, 1], values, torch.arange(0, 81, 4), [False, False])
        grad = torch.randn(10, 16, generator=gen)
        calls = []
        original = fbgemm_ops().split_embedding_backward_codegen_rowwise_adagrad_cpu

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        ops = fbgemm_ops()
        ops.split_embedding_backward_codegen_rowwise_adagrad_cpu = counted
        try:
            with torch.no_grad():
                RowWiseAdagrad(lr=0.1).backward_update(lookup, grad, [{"sum": s} for s in sums])
        finally:
            ops.split_embedding_backward_codegen_rowwise_adagrad_cpu = original
        return [w.clone() for w in weights] + [s.clone() for s in sums], len(calls)

    dtrec.ops.set_backend("auto")
    by_fbgemm, fbgemm_calls = run("fbgemm")
    by_torch, torch_calls = run("torch")
    assert (fbgemm_calls, torch_calls) == (1, 0)
    for a, b in zip(by_fbgemm, by_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expected one of"):
        cpu_choice.use_cpu_rowwise_adagrad("numpy")


def test_the_timed_lookup_is_served_by_both_implementations_alike() -> None:
    """What ``_time_both`` (and the benchmark calibration) time is a lookup each
    implementation serves: the C pass takes it, and it steps the tables as the unfused
    path does (a wrongly shaped gradient would be declined and time the fallback)."""
    import dtrec.kernels.cpu as cpu_kernels
    from dtrec.optim.cpu_choice import RowwiseAdagradLookup

    if not cpu_kernels.available():
        pytest.skip("dtrec's C kernels are not built here")

    def build() -> RowwiseAdagradLookup:
        gen = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, r, (512,), generator=gen) for r in (300, 700)]
        return RowwiseAdagradLookup.build(ids, (300, 700), 16, 8, gen)

    fused, unfused = build(), build()
    with torch.no_grad():
        assert fused.torch_pass()
        unfused.rows_then_update()
    for a, b in zip(fused.weights + [s["sum"] for s in fused.states],
                    unfused.weights + [s["sum"] for s in unfused.states], strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(fbgemm_ops() is None, reason="fbgemm_gpu does not load")
def test_one_thread_times_cpu_not_the_wall(monkeypatch) -> None:
    """With one torch thread the choice reads this thread's CPU time: a wall clock that
    jumps (the rank waiting for a core) while one implementation runs changes nothing."""
    import time

    threads = torch.get_num_threads()
    wall = {"now": 0.0}

    def jumpy() -> float:  # every read a second later: any wall-clock timing sees ~1 s
        wall["now"] += 1.0
        return wall["now"]

    monkeypatch.setattr(time, "perf_counter", jumpy)
    try:
        torch.set_num_threads(1)
        assert cpu_choice._clock() is time.thread_time
        times = cpu_choice._time_both(repeats=1)
        assert all(0 < t < 0.5 for t in times.values()), times
        torch.set_num_threads(2)
        assert cpu_choice._clock() is time.perf_counter
    finally:
        torch.set_num_threads(threads)
