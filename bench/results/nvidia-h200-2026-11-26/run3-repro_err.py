import faulthandler, sys
faulthandler.enable()
import torch
from kvkernels import ops
import kvkernels; print("torch", torch.__version__, kvkernels.__file__, flush=True)
try:
    torch.ones(2, 3) @ torch.ones(2, 3)
except Exception as e:
    print("torch's own error raised OK:", type(e).__name__, flush=True)
x = torch.randn(4, 64)
for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    try:
        ops.quantize_groups(x.to(dev), 5, 32, "sym", 0.0)
        print(dev, "NO ERROR (bug)", flush=True)
    except Exception as e:
        print(dev, "kvkernels error raised OK:", type(e).__name__, str(e)[:80], flush=True)
