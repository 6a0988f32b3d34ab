"""How long one large response holds up the rest of a running server (docs/serving.md, "Limits").

    python -m nanoengine.serve --port 8000 &
    python docs/response_stall.py http://127.0.0.1:8000

A stream of 1,000 tokens runs and /health is polled every 20 ms while one request asks for a 74 MB
answer (a 990-token prompt echoed with logprobs 20 to 128 choices); printed: that answer's size and
time, /health's slowest and median answer, and the stream's longest and median gap between chunks.
"""

import statistics
import sys
import threading
import time

import httpx

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
done, health, gaps = threading.Event(), [], []


def poll_health() -> None:
    with httpx.Client(timeout=60) as client:
        while not done.is_set():
            start = time.perf_counter()
            client.get(f"{url}/health")
            health.append(time.perf_counter() - start)
            time.sleep(0.02)


def stream() -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    last = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for _ in response.iter_lines():
            now = time.perf_counter()
            gaps.extend([now - last] if last is not None else [])
            last = now
            if done.is_set():
                break


threads = [threading.Thread(target=poll_health), threading.Thread(target=stream)]
for thread in threads:
    thread.start()
time.sleep(2)
large = {"prompt": "the quick brown fox jumps over the lazy dog " * 110, "n": 128, "max_tokens": 0, "echo": True,
         "logprobs": 20}
start = time.perf_counter()
response = httpx.post(f"{url}/v1/completions", json=large, timeout=600)
print(f"large response: {response.status_code}, {len(response.content) / 1e6:.1f} MB in "
      f"{time.perf_counter() - start:.2f} s")
time.sleep(1)
done.set()
for thread in threads:
    thread.join()
print(f"/health: slowest {max(health):.3f} s, median {statistics.median(health):.3f} s")
print(f"stream: longest gap {max(gaps):.3f} s, median {statistics.median(gaps):.3f} s")
