"""On the CUDA machine: a PFlash server model on the GPU sizes its KV pool from the device's free
memory minus the drafter reserve, and serves a compressed request.

python bench/gpu/pool.py MODEL.gguf  (write the GGUF in another process: see probe.py)
"""
import sys
import time

from pflash_plugin.engine.request import FinishEvent, Request, SamplingParams
from pflash_plugin.llama.devices import gpu_free_bytes
from pflash_plugin.server.runtime.models import ServedModel
from pflash_plugin.server.config.settings import ModelSettings

free = gpu_free_bytes()
served = ServedModel(ModelSettings(model=sys.argv[1], n_gpu_layers=99, n_ctx=4096, pflash="always",
                                   kv_pool_tokens=None, verbose=False, pflash_keep_ratio=0.3))
cache = served.engine.stats().cache
print("gpu free before", free, "pool tokens", cache.kv_pages_total * cache.kv_page_size)
done = []
request = Request(served.model.tokenize(" ".join(f"note {i}: the bridge opens at dawn." for i in range(40))),
                  SamplingParams(max_tokens=4, temperature=0), sink=lambda e: done.append(e))
plan = served.planner.plan(request.prompt_tokens, None)
request.compression, request.pflash = plan.job, plan.report
served.engine.submit(request)
for _ in range(300):
    if any(isinstance(e, FinishEvent) for e in done):
        break
    time.sleep(0.05)
print("finished", [e for e in done if isinstance(e, FinishEvent)][0].usage.pflash.to_json())
served.close()
