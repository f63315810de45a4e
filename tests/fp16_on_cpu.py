"""Run a script with DeepSpeed's CPU accelerator reporting fp16 support (test helper).

DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels for the host CPU; torch
still computes fp16 on any CPU (slowly). Tests start ``python tests/fp16_on_cpu.py
pretrain/main.py ARGS`` to run DeepSpeed's real fp16 optimizers and loss scaler here.
"""

import runpy
import sys

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

CPU_Accelerator.is_fp16_supported = lambda self: True
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
