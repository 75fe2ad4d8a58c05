"""How long an open stream stalls while many large chat bodies are prepared (event loop vs. prompt preparation).

One streamed completion runs on the tiny random Gemma 4 (custom-cpu, a real uvicorn socket); meanwhile N chat
requests with SIZE-character messages arrive at once, each refused after it was rendered and tokenized (its
max_tokens cannot fit), so only the preparation competes with the stream. Prints the stream's longest,
p99 and median gap between chunks.

Usage (repo root):  PYTHONPATH=core:plugins/custom_torch:tests:tests/server .venv/bin/python benchmarks/loop_stall.py 200 30000
"""
import asyncio, json, sys, tempfile, time
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/server")
import httpx
from server_harness import CHAT_TEMPLATE, ThreadedServer, reference_settings
from tiny_checkpoints import build_tiny_gemma4
from gemmaserve.engine.engine import Engine
from gemmaserve.server.app import create_app
from gemmaserve_custom_torch.backend import CustomTorchBackend
from gemmaserve_custom_torch.settings import load_custom_settings
from pathlib import Path
path = Path(tempfile.gettempdir()) / "gemmaserve-loop-stall-ckpt"
if not (path / "config.json").exists():
    build_tiny_gemma4(path, max_position_embeddings=16384)
    cfg = json.loads((path / "tokenizer_config.json").read_text()); cfg["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
settings = reference_settings(model=str(path), max_model_len=16384, max_active_kv_tokens=10**6, max_waiting_requests=1000)
engine = Engine(CustomTorchBackend.from_checkpoint(path, "cpu", settings, load_custom_settings()), settings)
app = create_app(engine, "m")
server = ThreadedServer(app)
N, SIZE = int(sys.argv[1]), int(sys.argv[2])
async def main():
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=httpx.Limits(max_connections=1000)) as c:
        gaps = []
        async def stream():
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
            last = None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        if last is not None: gaps.append(now - last)
                        last = now
        text = ("the quick brown fox jumps over the lazy dog " * (SIZE // 44))[:SIZE]
        async def chat():
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 16384})
            return r.status_code
        s = asyncio.create_task(stream())
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        codes = await asyncio.gather(*(chat() for _ in range(N)))
        t1 = time.perf_counter()
        await s
        gaps.sort()
        print(f"N={N} size={SIZE}: chats took {t1-t0:.2f}s codes={set(codes)}; stream gap max {gaps[-1]*1e3:.0f} ms p99 {gaps[int(len(gaps)*0.99)]*1e3:.0f} ms median {gaps[len(gaps)//2]*1e3:.1f} ms")
asyncio.run(main())
server.stop(); engine.shutdown(timeout=10)
