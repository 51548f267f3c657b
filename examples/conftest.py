import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter; it is read at kernel
# definition, so set it before the examples import Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import graphcap.env  # graphcap reads its environment at import: read it again

    graphcap.env.reload()
