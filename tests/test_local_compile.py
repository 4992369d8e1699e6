"""``compile``: the compiled forward is the same model, built off the serving path, optional; ``auto``
(the default) starts once the model serves and keeps whichever forward times faster."""

from __future__ import annotations

import threading

import anyio
import pytest

from multiplexer.core.call import Call
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import MINILM, local_config, sentence, tiny_classifier

pytestmark = pytest.mark.anyio
torch = pytest.importorskip("torch")


def has_compiler() -> bool:
    """Inductor builds C++ kernels on the CPU; without a compiler ``compile: true`` stays eager."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:
        return False


needs_compiler = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler for inductor")

TEXTS = ["hi", sentence(1, 40), "a cat sat on the mat", sentence(2, 120), "", sentence(3, 8)]


def config(source: str, task: str, route: str, **model: object):
    return local_config({"m": {"source": source, "task": task, "device": "cpu", **model}},
                        {route: {"provider": "local", "model": "m"}})


def events(gw: Gateway, event: str) -> float:
    return gw.metrics.registry.get_sample_value(
        "multiplexer_events_total", {"component": "local", "event": event}) or 0.0


async def vectors(gw: Gateway, value: object) -> torch.Tensor:
    outcome = await gw.submit(Call("embed_local", {"input": value}))
    assert outcome.ok, outcome.error
    return torch.tensor([d["embedding"] for d in outcome.result["data"]])


@needs_compiler
async def test_compiled_embeddings_equal_eager_ones_and_calls_never_wait_for_the_compile(monkeypatch) -> None:
    import local_models.pool as pool_module

    release = threading.Event()
    real = pool_module.compiled_forward

    def held(*args, **kwargs):  # the compile cannot finish until the eager answers are in
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(pool_module, "compiled_forward", held)
    # A bound of our own: should a call ever stall here, anyio cancels it and the failure
    # shows where (pytest-timeout's alarm did not fire in one such stall on a loaded host).
    with anyio.fail_after(100):
        await _compile_while_serving(release)


async def _compile_while_serving(release: threading.Event) -> None:
    async with Gateway(config(MINILM, "embed", "embed_local", compile=True, max_wait_ms=20)) as gw:
        pool = gw.providers["local"].pool
        handle = await pool.ready("m")
        eager_batch = await vectors(gw, TEXTS)
        eager_single = torch.cat([await vectors(gw, t) for t in TEXTS])
        assert not handle.warm.is_set() and handle.packed.forward is None  # eager: attention row by row
        assert handle.budget.max_padding == 1.0  # so padding is free
        release.set()
        await pool.warm("m")
        assert handle.packed.forward is not None  # swapped in
        assert handle.budget.max_padding == 0.1  # the compiled forward attends on the padded grid
        assert events(gw, "compiled") == 1 and events(gw, "compile_failed") == 0
        batches = pool.stats("m").batches
        compiled_single = torch.cat([await vectors(gw, t) for t in TEXTS])
        results: dict[int, torch.Tensor] = {}

        async def caller(i: int) -> None:
            results[i] = await vectors(gw, TEXTS[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(TEXTS)):
                tg.start_soon(caller, i)
        assert pool.stats("m").batches - batches < 2 * len(TEXTS)  # the concurrent callers shared passes
    compiled_shared = torch.cat([results[i] for i in range(len(TEXTS))])
    for got in (compiled_single, compiled_shared):
        assert (got - eager_single).abs().max().item() < 1e-5
    assert (eager_batch - eager_single).abs().max().item() < 1e-5


async def test_a_failed_compile_keeps_the_eager_forward(monkeypatch, caplog) -> None:
    import local_models.compiling as compiling

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiling, "_compiled", {})
    monkeypatch.setattr(compiling.torch, "compile", no_compiler)
    async with Gateway(config(MINILM, "embed", "embed_local", compile=True)) as gw:
        handle = await gw.providers["local"].pool.warm("m")
        assert handle.packed.forward is None
        assert events(gw, "compile_failed") == 1 and events(gw, "compiled") == 0
        assert (await vectors(gw, ["still", "served"])).shape == (2, 384)
    assert "compile failed" in caplog.text and "no C++ compiler" in caplog.text


@needs_compiler
async def test_a_compiled_padded_classifier_gives_the_eager_scores(tmp_path) -> None:
    source = str(tiny_classifier(tmp_path))
    texts = [sentence(i, n) for i, n in enumerate((2, 9, 4, 15))]
    scores = []
    for compile in (False, True):
        async with Gateway(config(source, "classify", "classify", compile=compile)) as gw:
            handle = await gw.providers["local"].pool.warm("m")
            assert (handle.compiled_model is not None) == compile
            outcome = await gw.submit(Call("classify", {"input": texts}))
            assert outcome.ok, outcome.error
            scores.append([[s["score"] for s in row["scores"]] for row in outcome.result["data"]])
    assert torch.tensor(scores[0]).sub(torch.tensor(scores[1])).abs().max().item() < 1e-5


@pytest.fixture
def fake_compiler(monkeypatch) -> tuple[list[str], list[float]]:
    """Compiling faked (a wrapper of the eager module that counts its calls) and the timing
    injected (ratios popped in order): for tests of when auto compiles and what it keeps."""
    import local_models.pool as pool_module

    compiled_calls: list[str] = []
    ratios: list[float] = []

    class Compiled:  # as torch.compile's module: callable, the rest of the model's attributes read through
        def __init__(self, kind, module) -> None:
            self.kind, self.module = kind, module

        def __call__(self, *args, **kwargs):
            compiled_calls.append(self.kind)
            return self.module(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.module, name)

    def fake_compile(owner, kind, module, warm):
        forward = Compiled(kind, module)
        warm(forward)
        return forward

    def fake_timing(compiled, eager):  # the compiled side comes first; the ratio is compiled / eager
        before = len(compiled_calls)
        compiled()
        assert len(compiled_calls) == before + 1
        eager()
        assert len(compiled_calls) == before + 1
        return ratios.pop(0)

    monkeypatch.setattr(pool_module, "compiler_available", lambda: True)
    monkeypatch.setattr(pool_module, "compiled_forward", fake_compile)
    monkeypatch.setattr(pool_module, "time_ratio", fake_timing)
    return compiled_calls, ratios


async def test_auto_compiles_once_the_model_serves_and_keeps_the_faster_forward(fake_compiler) -> None:
    compiled_calls, ratios = fake_compiler
    auto = config(MINILM, "embed", "embed_local", compile="auto", linear="torch")

    ratios.append(1.02)  # not faster here: the eager forward stays
    async with Gateway(auto) as gw:
        pool = gw.providers["local"].pool
        handle = await pool.ready("m")
        assert not handle.compile_started and not handle.warm.is_set()  # loaded: nothing compiles yet
        eager = await vectors(gw, TEXTS)
        assert handle.compile_started  # the first batch has its answers: now it does
        handle = await pool.warm("m")
        assert handle.packed.forward is None
        assert events(gw, "compile_slower") == 1 and events(gw, "compiled") == 0
        served = len(compiled_calls)
        assert (await vectors(gw, TEXTS) - eager).abs().max().item() < 1e-6
        assert len(compiled_calls) == served  # answers still come from the eager forward

    ratios.append(0.9)  # faster: swapped in; warm() alone starts it when no call has
    async with Gateway(auto) as gw:
        handle = await gw.providers["local"].pool.warm("m")
        assert handle.packed.forward is not None
        assert events(gw, "compiled") == 1 and events(gw, "compile_slower") == 0
        served = len(compiled_calls)
        assert (await vectors(gw, TEXTS) - eager).abs().max().item() < 1e-5
        assert len(compiled_calls) > served
    assert ratios == []


async def test_auto_on_a_padded_classifier_swaps_in_only_a_faster_forward(fake_compiler, tmp_path) -> None:
    compiled_calls, ratios = fake_compiler
    auto = config(str(tiny_classifier(tmp_path)), "classify", "classify", compile="auto", linear="torch")
    texts = [sentence(i, n) for i, n in enumerate((2, 9, 4, 15))]
    scores = []
    for ratio in (1.05, 0.9):
        ratios.append(ratio)
        async with Gateway(auto) as gw:
            handle = await gw.providers["local"].pool.warm("m")
            assert (handle.compiled_model is not None) == (ratio < 1)
            served = len(compiled_calls)
            outcome = await gw.submit(Call("classify", {"input": texts}))
            assert outcome.ok, outcome.error
            assert (len(compiled_calls) > served) == (ratio < 1)  # who answered: eager, then compiled
            scores.append([[s["score"] for s in row["scores"]] for row in outcome.result["data"]])
    assert torch.tensor(scores[0]).sub(torch.tensor(scores[1])).abs().max().item() < 1e-6


async def test_daemon_work_hands_back_its_result_or_error() -> None:
    from local_models.daemon import run_daemon

    assert await run_daemon(lambda: threading.current_thread().daemon, "check") is True

    def broken() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await run_daemon(broken, "broken")


def test_a_model_still_loading_does_not_hold_the_process_open() -> None:
    """The gateway closes while a load blocks; the process exits (a worker thread would keep it)."""
    import subprocess
    import sys

    script = """
import threading, anyio
from local_models import pool
started = threading.Event()

def load_forever(self):
    started.set()
    threading.Event().wait()

pool.ModelHandle.load_sync = load_forever
from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import MINILM, local_config

async def main():
    async with Gateway(local_config({"m": {"source": MINILM, "task": "embed", "device": "cpu"}})) as gw:
        while not started.is_set():  # the load is under way on its thread
            await anyio.sleep(0.01)
        assert not gw.providers["local"].pool.handles["m"].ready.is_set()

anyio.run(main)
print("closed")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "closed"


def test_defaults_come_from_the_host(monkeypatch) -> None:
    """One batch per core on CPU (up to 4) on cores / concurrency threads; compile off unless asked,
    and ``auto`` only where inductor finds a C++ compiler."""
    import local_models.devices as devices
    import local_models.pool as pool_module
    from local_models.pool import ModelHandle
    from local_models.spec import ModelSpec

    def handle(**spec: object) -> ModelHandle:
        return ModelHandle("m", ModelSpec(source=MINILM, task="embed", device="cpu", **spec),
                           cache_dir=None, on_event=lambda m, e: None)

    for cores, concurrency, threads in ((1, 1, 1), (2, 2, 1), (16, 4, 4)):
        monkeypatch.setattr(devices, "cores", lambda n=cores: n)
        assert handle().concurrency == concurrency
        assert devices.auto_threads([handle().concurrency]) == threads
    assert handle(concurrency=3).concurrency == 3
    monkeypatch.setattr(devices, "cores", lambda: 2)
    assert devices.auto_threads([1]) == 2 and devices.auto_threads([]) == 2
    assert not handle(compile=False).compiles() and handle(compile=True).compiles()
    for found in (True, False):
        monkeypatch.setattr(pool_module, "compiler_available", lambda found=found: found)
        assert handle().compiles() is found and handle(compile="auto").compiles() is found
        onednn = handle()
        onednn.linear = "onednn"  # oneDNN's layers won at load: auto spends no compile
        assert not onednn.compiles() and handle(compile=True).compiles()
    assert not ModelHandle("g", ModelSpec(source=MINILM, task="generate", compile=True),
                           cache_dir=None, on_event=lambda m, e: None).compiles()
