"""
Per-example gradient norm layers: drop-in Linear, Embedding and LayerNorm classes whose
backward pass also accumulates, for every trainable parameter p, the running sum over
examples b of ||g_b / B||^2 (the per-example gradient as the layer sees it), in float32.

Buffer convention (shared with fused_gns.py and read by gnstracking.py):
- a measured module has a non-persistent float32 0-dim buffer `example_count` (examples seen
  since the last zeroing, summed over gradient-accumulation micro-steps), and
- for each of its parameters `name`, a non-persistent float32 0-dim buffer `{name}_sqgradnorm`.
Non-persistent buffers stay out of state_dict, so checkpoints load into plain nanoGPT and back.
Under a float16 GradScaler the loss is scaled by s, so the buffers hold s^2 times the true
sums: the tracker divides by s^2, the layers never see s.
"""
import torch


def register_sqgradnorm_buffers(module):
    """Give `module` an example counter and one float32 running-sum buffer per own parameter."""
    for name, _ in module.named_parameters(recurse=False):
        module.register_buffer(f"{name}_sqgradnorm", torch.zeros((), dtype=torch.float32), persistent=False)
    module.register_buffer("example_count", torch.zeros((), dtype=torch.float32), persistent=False)


def find_sqgradnorm_buffers(model):
    """
    One (name, parameter, sqgradnorm buffer, count buffer) per measured trainable parameter,
    in model.named_parameters() order, each parameter once (tied ones under their first name).
    """
    found = {}
    for module in model.modules():
        if "example_count" not in module._buffers:
            continue
        for pname, p in module.named_parameters(recurse=False):
            buf = module._buffers.get(f"{pname}_sqgradnorm")
            if buf is not None and p.requires_grad and id(p) not in found:
                found[id(p)] = (buf, module._buffers["example_count"])
    return [(n, p, *found[id(p)]) for n, p in model.named_parameters() if id(p) in found]


@torch.no_grad()
def zero_sqgradnorm_buffers(model):
    """Zero every per-example-norm buffer in place (after each optimizer step)."""
    for module in model.modules():
        if "example_count" in module._buffers:
            for name, buf in module._buffers.items():
                if name == "example_count" or name.endswith("_sqgradnorm"):
                    buf.zero_()


def tie_weights(embedding, head):
    """Tie the token embedding to the output head (GPT's wte = lm_head), as nanoGPT does."""
    embedding.weight = head.weight
