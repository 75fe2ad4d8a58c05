"""How long an open stream stalls while many large chat bodies are prepared (event loop vs. prompt preparation).

The server (tiny random Gemma 4 on custom-cpu, a real uvicorn socket) runs in this process. Two client processes
talk to it, so that neither client's own work is counted as a server stall: one reads streamed completions back
to back (a fresh one whenever one ends) and records the gaps between chunks; the other sends N chat requests
with SIZE-character messages at once, each refused after it was rendered and tokenized (its max_tokens cannot
fit), so only the preparation competes with the stream. Prints the stream's longest, p99 and median gap between
chunks while the chats were in flight, and the server event loop's longest lag (a 5 ms sleep on it that woke
late). ``--floor``: chats are refused before they are prepared (what reading and answering N bodies alone
costs). ``RENDER_PROCESSES=0`` renders on the preparation threads (no render pool).

Usage (repo root):  PYTHONPATH=core:plugins/custom_torch:tests:tests/server .venv/bin/python benchmarks/loop_stall.py 200 30000
"""
import asyncio, json, os, subprocess, sys, tempfile, time
from pathlib import Path


def stream_client(url: str, stop_file: str) -> None:
    """Streams 400-token completions one after another until ``stop_file`` exists; prints the gaps (JSON)."""
    import httpx
    gaps: list[float] = []
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=600) as c:
        while not os.path.exists(stop_file):
            last = None
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        if last is not None:
                            gaps.append(now - last)
                        elif len(gaps) == 0:
                            print("started", flush=True)
                        last = now
                    if os.path.exists(stop_file):
                        break
    print(json.dumps(gaps), flush=True)


def load_client(url: str, n: int, size: int) -> None:
    """N chat requests with SIZE-character messages at once; prints the seconds they took and their codes."""
    import httpx
    text = ("the quick brown fox jumps over the lazy dog " * (size // 44 + 1))[:size]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1000)) as c:
            async def chat() -> int:
                r = await c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 16384,
                                                               "messages": [{"role": "user", "content": text}]})
                return r.status_code
            t0 = time.perf_counter()
            codes = await asyncio.gather(*(chat() for _ in range(n)))
            print(json.dumps({"seconds": time.perf_counter() - t0, "codes": sorted(set(codes))}), flush=True)
    asyncio.run(main())


def run_server(n: int, size: int, floor: bool) -> None:
    sys.path.insert(0, "tests"); sys.path.insert(0, "tests/server")
    from server_harness import CHAT_TEMPLATE, ThreadedServer, reference_settings
    from tiny_checkpoints import build_tiny_gemma4
    from gemmaserve.engine.engine import Engine
    from gemmaserve.server import app as app_module
    from gemmaserve.server.errors import APIError
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.settings import load_custom_settings
    path = Path(tempfile.gettempdir()) / "gemmaserve-loop-stall-ckpt"
    if not (path / "config.json").exists():
        build_tiny_gemma4(path, max_position_embeddings=16384)
        cfg = json.loads((path / "tokenizer_config.json").read_text()); cfg["chat_template"] = CHAT_TEMPLATE
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if floor:
        prepare = app_module._Server._prepare
        def refuse(self, raw, endpoint):  # type: ignore[no-untyped-def]
            if endpoint == "chat":
                raise APIError(400, "refused unprepared (--floor)")
            return prepare(self, raw, endpoint)
        app_module._Server._prepare = refuse
    settings = reference_settings(model=str(path), max_model_len=16384, max_active_kv_tokens=10**6,
                                  max_waiting_requests=1000)
    engine = Engine(CustomTorchBackend.from_checkpoint(path, "cpu", settings, load_custom_settings()), settings)
    app = app_module.create_app(engine, "m")
    lags: list[float] = []
    probing = [True]

    @app.get("/_loop_probe")
    async def loop_probe() -> dict[str, str]:  # starts a task that records how late a 5 ms sleep wakes
        async def probe() -> None:
            while probing[0]:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)
        asyncio.get_running_loop().create_task(probe())
        return {}

    server = ThreadedServer(app)
    import httpx
    httpx.get(server.base_url + "/_loop_probe")
    time.sleep(3.0 if os.environ.get("RENDER_PROCESSES", "-1") != "0" else 0.5)  # the render workers start
    stop_file = tempfile.mktemp(prefix="gemmaserve-loop-stall-stop")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    me = [sys.executable, __file__]
    stream = subprocess.Popen([*me, "--stream", server.base_url, stop_file], stdout=subprocess.PIPE, text=True, env=env)
    assert stream.stdout is not None
    assert stream.stdout.readline().strip() == "started"
    time.sleep(1.0)
    load = subprocess.run([*me, "--load", server.base_url, str(n), str(size)], capture_output=True, text=True, env=env,
                          check=True)
    Path(stop_file).touch()
    probing[0] = False
    gaps = sorted(json.loads(stream.stdout.readline()))
    stream.wait()
    os.unlink(stop_file)
    result = json.loads(load.stdout)
    label = f"N={n} size={size}{' (floor)' if floor else ''}"
    print(f"{label}: chats took {result['seconds']:.2f}s codes={result['codes']}; "
          f"stream gap max {gaps[-1]*1e3:.0f} ms p99 {gaps[int(len(gaps)*0.99)]*1e3:.0f} ms "
          f"median {gaps[len(gaps)//2]*1e3:.1f} ms ({len(gaps)} gaps); loop lag max {max(lags)*1e3:.0f} ms "
          f"total>10ms {sum(x for x in lags if x > 0.01):.2f}s; render workers "
          f"{len(app.state.render_pool.worker_pids()) if app.state.render_pool else 0}")
    server.stop(); engine.shutdown(timeout=10)


if __name__ == "__main__":
    if sys.argv[1] == "--stream":
        stream_client(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--load":
        load_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        args = [a for a in sys.argv[1:] if a != "--floor"]
        run_server(int(args[0]), int(args[1]), "--floor" in sys.argv)
