"""H100: where a model step's GPU time goes, flashref against SDPA, eager and compiled with CUDA graphs (B 4,
T 4096, the model of notebook 11): the kernels by GPU time over five profiled steps, and each step's total.
Stop 67 measured the branch's compiled step at 9.16 ms against SDPA's 7.68, a gap larger than eager attention's
GPU-time gap (3.75 against 3.25 ms): this says where the rest is. Run: PYTHONPATH=$PWD python3
gpu_todo/profile_compiled.py"""
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from flashref.bench import model_bench as mb

T, B, STEPS = 4096, 4, 5
for attention in ("sdpa", "flashref"):
    for mode in (None, "reduce-overhead"):
        step = mb._trainer(mb._build(attention, T), B, T, compiled=mode)
        ms = mb._step_time(step)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type == DeviceType.CPU:
                for kn in e.kernels:  # (graph replays: the kernels hang under the graph's launch)
                    kernels[kn.name] = kernels.get(kn.name, 0.0) + kn.duration / STEPS
        total = sum(kernels.values())
        print(f"\n{attention} {mode or 'eager'}: step {ms:.2f} ms (wall), kernels {total / 1e3:.2f} ms a step")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:18]:
            print(f"  {us:9.1f} us  {name[:110]}")
        del step
        torch._dynamo.reset()
        torch.cuda.empty_cache()
