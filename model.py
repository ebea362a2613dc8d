"""
The GPT language model, one file, as in nanoGPT: token + position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, a final LayerNorm and an output head tied to
the token embedding. Four GPTConfig fields turn it, piece by piece, into a Llama-style model
(Touvron et al. 2023): norm='rmsnorm', mlp='swiglu', pos_emb='rope', tie_embeddings=False;
their defaults are GPT-2's, so older configs and checkpoints build the same model as before.
n_expert > 0 makes every MLP a mixture of experts (MoE: a router and n_expert GELU experts).

The Linear / Embedding / LayerNorm / RMSNorm classes come from layer_config, read when the model
is constructed, so the same file builds a plain GPT or one whose layers measure per-example
gradient norms (nanogns/layers, fused_gns.py).
"""
import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogns.layers.config import get_contextual_config, tie_weights

# Peak dense FLOP/s used as the MFU denominator. The first entries are datasheet bfloat16
# numbers; the *_eflops entries are empirically reachable ceilings for devices whose datasheet
# peak is far from what a matmul actually gets.
PEAK_FLOPS = {
    'A100': 312e12,
    'A10': 125e12,
    'H100': 989e12,
    'H200': 989e12,
    'M1_eflops': 4.35e12,
    'A10_eflops': 69e12,
}


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, like GPT-2; False is a bit better and faster
    device_name: str = 'A100'  # key of PEAK_FLOPS for estimate_mfu
    cos_attn: list = field(default_factory=list)  # block indices using cosine attention
    spectral_c_attn: list = field(default_factory=list)  # block indices with spectral-normalised Q/K/V
    fp32_attention_layers: list = field(default_factory=list)  # block indices whose attention runs in float32
    # Llama-style options (ARCHITECTURE_CHOICES); the defaults are GPT-2's
    norm: str = 'layernorm'  # or 'rmsnorm': a gain, no bias and no centring (Zhang & Sennrich 2019)
    mlp: str = 'gelu'  # or 'swiglu': a SiLU-gated MLP of width swiglu_hidden(n_embd) (Shazeer 2020)
    pos_emb: str = 'learned'  # or 'rope': Q and K rotated by position, no wpe parameter (Su et al. 2021)
    tie_embeddings: bool = True  # lm_head shares wte's weight (Press & Wolf 2017); False: two matrices
    # mixture of experts (MoE): n_expert > 0 makes every MLP n_expert GELU experts of the MLP's width and a
    # router sending each token to n_expert_active of them; moe_aux_loss_coef weighs the load-balancing loss
    n_expert: int = 0
    n_expert_active: int = 2
    moe_aux_loss_coef: float = 0.0


# the values of GPTConfig's string options; train.py's flags of the same names take them too
ARCHITECTURE_CHOICES = {'norm': ('layernorm', 'rmsnorm'), 'mlp': ('gelu', 'swiglu'), 'pos_emb': ('learned', 'rope')}


def architecture_error(config):
    """Why `config` (a GPTConfig, or train.py's dict of values) cannot be built, in one line; None if it can."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
    for key, allowed in ARCHITECTURE_CHOICES.items():
        if get(key) not in allowed:
            return f"{key}={get(key)!r} is not one of {', '.join(allowed)}"
    if not isinstance(get('tie_embeddings'), bool):
        return f"tie_embeddings={get('tie_embeddings')!r} must be True or False"
    n_expert, active, coef = get('n_expert'), get('n_expert_active'), get('moe_aux_loss_coef')
    if not isinstance(n_expert, int) or isinstance(n_expert, bool) or n_expert < 0:
        return f"n_expert={n_expert!r} must be a whole number >= 0 (0: a dense MLP)"
    if n_expert and (not isinstance(active, int) or isinstance(active, bool) or not 1 <= active <= n_expert):
        return f"n_expert_active={active!r} must be a whole number from 1 to n_expert={n_expert}"
    if n_expert and get('mlp') != 'gelu':
        return f"n_expert={n_expert} builds GELU experts: mlp={get('mlp')!r} experts are not built (use mlp='gelu')"
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not coef >= 0:
        return f"moe_aux_loss_coef={coef!r} must be a number >= 0"
    if get('pos_emb') == 'rope' and (get('n_embd') // get('n_head')) % 2:
        return (f"pos_emb='rope' rotates pairs of features, so the head size n_embd / n_head = "
                f"{get('n_embd')} / {get('n_head')} must be even")
    return None


def rope_angles(T, head_size, device, base=10000.0):
    """
    cos and sin, [T, head_size / 2] float32, of the rotary position embedding's angles
    t * base^(-2i / head_size) for positions t < T (Su et al. 2021, "RoFormer", §3.2). Computed
    in each forward rather than kept as buffers: nothing to crop (crop_block_size), to cast
    (model.to(bfloat16) would round them) or to leave out of checkpoints. Elementwise products
    only, which autocast leaves in float32.
    """
    inv_freq = base ** -(torch.arange(0, head_size, 2, device=device, dtype=torch.float32) / head_size)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """
    x [B, n_head, T, head_size] with each feature pair (i, i + head_size/2) rotated by its position's
    angle, computed in float32 and returned in x's dtype. Llama pairs neighbours (2i, 2i+1) instead:
    the same up to a fixed permutation of the Q/K features, which the projections absorb.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def swiglu_hidden(n_embd):
    """
    SwiGLU's hidden width: 2/3 of the GELU MLP's 4 * n_embd, so that its three matrices hold about
    as many weights as GELU's two (Shazeer 2020, as Llama does), rounded up to a multiple of 64 for
    the matmuls (Llama rounds to 256, too coarse for small models): 768 -> 2048, 128 -> 384, 32 -> 128.
    """
    return (8 * n_embd + 191) // 192 * 64


def norm_layer(config, layers):
    """ln_1 / ln_2 / ln_f: LayerNorm (with a bias if config.bias) or RMSNorm (a gain only), both from
    the layer config so that --lnclass measures whichever the model uses. RMSNorm's eps is LayerNorm's
    1e-5 (Llama 2's too); torch's default would be the machine epsilon of the input's dtype."""
    if config.norm == 'rmsnorm':
        return layers['RMSNorm'](config.n_embd, eps=1e-5)
    return layers['LayerNorm'](config.n_embd, bias=config.bias)


class SpectralNormQKV(nn.Module):
    """Separate Q, K, V projections, each spectrally normalised (Miyato et al. 2018) and scaled
    by a fixed 1.1, returned as one [B, T, 3C] tensor like the fused c_attn."""

    def __init__(self, n_embd, bias, Linear):
        super().__init__()
        sn = torch.nn.utils.parametrizations.spectral_norm
        self.q = sn(Linear(n_embd, n_embd, bias=bias))
        self.k = sn(Linear(n_embd, n_embd, bias=bias))
        self.v = sn(Linear(n_embd, n_embd, bias=bias))
        self.register_buffer('scale', torch.tensor(1.1), persistent=False)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1) * self.scale


class CausalSelfAttention(nn.Module):

    def __init__(self, config, block_idx, layers):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        if block_idx in config.spectral_c_attn:
            self.c_attn = SpectralNormQKV(config.n_embd, config.bias, layers['Linear'])
        else:
            self.c_attn = layers['Linear'](config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = layers['Linear'](config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.cos_attn = block_idx in config.cos_attn
        self.fp32 = block_idx in config.fp32_attention_layers

    def attend(self, q, k, v, rope):
        if rope is not None:  # inside the fp32 layers' float32 region, like the rest of attention
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.cos_attn:
            # cosine attention: unit-norm queries and keys bound every attention logit
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x, rope=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.fp32:
            with torch.autocast(device_type=x.device.type, enabled=False):
                y = self.attend(q.float(), k.float(), v.float(), rope).to(v.dtype)
        else:
            y = self.attend(q, k, v, rope)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config, layers):
        super().__init__()
        self.c_fc = layers['Linear'](config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = layers['Linear'](4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """Llama's MLP, c_proj(silu(c_gate(x)) * c_fc(x)): a gated linear unit whose gate goes through
    SiLU (Shazeer 2020, "GLU Variants Improve Transformer"), hidden width swiglu_hidden(n_embd)."""

    def __init__(self, config, layers):
        super().__init__()
        hidden = swiglu_hidden(config.n_embd)
        self.c_fc = layers['Linear'](config.n_embd, hidden, bias=config.bias)
        self.c_gate = layers['Linear'](config.n_embd, hidden, bias=config.bias)
        self.c_proj = layers['Linear'](hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


class MoE(nn.Module):
    """
    A mixture-of-experts MLP (Shazeer et al. 2017; top-k routing as in Mixtral, Jiang et al. 2024):
    the router, a Linear, gives each token a softmax over n_expert experts; the token goes to its
    n_expert_active most probable ones, their GELU MLPs' outputs weighted by those probabilities (not
    renormalised, so that one active expert still trains the router, as in Switch, Fedus et al. 2022).

    In training with moe_aux_loss_coef > 0 it keeps Switch's load-balancing loss in `aux_loss`,
    n_expert * sum_e f_e P_e, f_e the fraction of routed token slots that went to expert e (not
    differentiated) and P_e the mean router probability of e, over the forward's tokens; GPT adds it to
    the loss. It is a sum over tokens with f fixed by the whole batch, so the per-example gradient that is
    measured with it on is that of example b's own tokens' share of it, f held at the batch's value.
    """

    def __init__(self, config, layers):
        super().__init__()
        self.router = layers['Linear'](config.n_embd, config.n_expert, bias=False)
        self.experts = layers['Experts'](config.n_expert, config.n_embd, 4 * config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.n_expert, self.n_active, self.aux_coef = config.n_expert, config.n_expert_active, config.moe_aux_loss_coef
        self.aux_loss = None

    def forward(self, x):
        probs = self.router(x).float().softmax(-1)  # [B, T, n_expert]
        weight, index = probs.topk(self.n_active, dim=-1)
        y = self.experts(x, index, weight)
        self.aux_loss = None
        if self.training and self.aux_coef > 0:
            share = torch.bincount(index.view(-1), minlength=self.n_expert).float() / index.numel()
            self.aux_loss = self.n_expert * (share * probs.mean(dim=(0, 1))).sum()
        return self.dropout(y)


class Block(nn.Module):

    def __init__(self, config, block_idx, layers):
        super().__init__()
        self.ln_1 = norm_layer(config, layers)
        self.attn = CausalSelfAttention(config, block_idx, layers)
        self.ln_2 = norm_layer(config, layers)
        if config.n_expert:
            self.mlp = MoE(config, layers)
        else:
            self.mlp = SwiGLU(config, layers) if config.mlp == 'swiglu' else MLP(config, layers)

    def forward(self, x, rope=None):
        x = x + self.attn(self.ln_1(x), rope)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        if config.device_name not in PEAK_FLOPS:
            raise ValueError(f"unknown device_name {config.device_name!r}; choose from {sorted(PEAK_FLOPS)}")
        error = architecture_error(config)
        if error:
            raise ValueError(error)
        self.config = config
        layers = get_contextual_config()  # read now, not at import: see nanogns/layers/config.py

        # built in nanoGPT's order (wte, wpe, drop, h, ln_f), which fixes the random draws of the init
        self.transformer = nn.ModuleDict(dict(wte=layers['Embedding'](config.vocab_size, config.n_embd)))
        if config.pos_emb == 'learned':  # rope rotates Q and K instead and has no parameters
            self.transformer.wpe = layers['Embedding'](config.block_size, config.n_embd)
        self.transformer.update(dict(
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i, layers) for i in range(config.n_layer)]),
            ln_f=norm_layer(config, layers),
        ))
        self.lm_head = layers['Linear'](config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # weight tying (Press & Wolf 2017), nanoGPT's wte.weight = lm_head.weight; when both layers
            # measure, tie_weights also links them so the shared weight's per-example norm is exact.
            # Untied, wte and lm_head are two parameters, each measured by its own layer.
            tie_weights(self.transformer.wte, self.lm_head)
        # tokens seen in training, checkpointed with the weights (the LR schedule is in tokens)
        self.register_buffer('tokens_processed', torch.zeros((), dtype=torch.int64))

        self.apply(self._init_weights)
        # scaled init of the residual projections, per the GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight') or pn.endswith('experts.c_proj'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        print("number of parameters: %.2fM" % (self.get_num_params() / 1e6,))

    def get_num_params(self, non_embedding=True):
        """Parameter count; by default without the embeddings' lookup tables: the position embeddings
        (if learned) and, untied, the token embeddings. Tied, those count, since they are also the
        output head's weights (what estimate_mfu needs: the parameters that cost matmul flops)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if 'wpe' in self.transformer:
                n_params -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n_params -= self.transformer.wte.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}")
        x = self.transformer.wte(idx)
        rope = None
        if self.config.pos_emb == 'rope':
            rope = rope_angles(t, self.config.n_embd // self.config.n_head, idx.device)
        else:
            # positions get a batch dimension so the position embedding sees per-example gradients
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device).expand(b, t)
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, rope)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            aux = [b.mlp.aux_loss for b in self.transformer.h if getattr(b.mlp, 'aux_loss', None) is not None]
            if aux:  # the mixture of experts' load-balancing losses (MoE)
                loss = loss + self.config.moe_aux_loss_coef * sum(aux)
        else:
            # inference: only the last position's logits (the list keeps the time dimension)
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        """Model surgery to use a smaller block size than the model was built with."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if 'wpe' in self.transformer:  # rope's angles are computed for each forward's length
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
            self.transformer.wpe.num_embeddings = block_size

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """GPT-2 weights from Hugging Face transformers (needs the package and the network)."""
        assert model_type in {'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'}
        override_args = override_args or {}
        assert all(k == 'dropout' for k in override_args)
        print("loading weights from pretrained gpt: %s" % model_type)
        config_args = {
            'gpt2': dict(n_layer=12, n_head=12, n_embd=768),  # 124M params
            'gpt2-medium': dict(n_layer=24, n_head=16, n_embd=1024),  # 350M params
            'gpt2-large': dict(n_layer=36, n_head=20, n_embd=1280),  # 774M params
            'gpt2-xl': dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M params
        }[model_type]
        config_args.update(vocab_size=50257, block_size=1024, bias=True)
        if 'dropout' in override_args:
            config_args['dropout'] = override_args['dropout']
        # download first: fail before building (a missing package or network is the caller's to report)
        from transformers import GPT2LMHeadModel
        model_hf = GPT2LMHeadModel.from_pretrained(model_type)
        model = GPT(GPTConfig(**config_args))
        sd = model.state_dict()
        sd_hf = {k: v for k, v in model_hf.state_dict().items()
                 if not k.endswith('.attn.masked_bias') and not k.endswith('.attn.bias')}
        # OpenAI's checkpoints use Conv1D, whose weights are the transpose of a Linear's
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        with torch.no_grad():
            for k, v in sd_hf.items():
                v = v.t() if k.endswith(transposed) else v
                assert v.shape == sd[k].shape, f"shape mismatch for {k}: {v.shape} vs {sd[k].shape}"
                sd[k].copy_(v)
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, fused=True):
        """AdamW; matrices (>= 2-D) are weight-decayed, biases and LayerNorm / RMSNorm gains are not. fused=False:
        never the fused one (FSDP's float16 GradScaler gives it a found_inf of a shape it cannot take)."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay_params = [p for p in params if p.dim() >= 2]
        nodecay_params = [p for p in params if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0},
        ]
        print(f"num decayed parameter tensors: {len(decay_params)}, with {sum(p.numel() for p in decay_params):,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {sum(p.numel() for p in nodecay_params):,} parameters")
        # fused: one kernel for all the parameters, and a step it skips on the device (step_unless_nonfinite)
        use_fused = fused and 'fused' in inspect.signature(torch.optim.AdamW).parameters and device_type in ('cuda', 'cpu')
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas,
                                      **(dict(fused=True) if use_fused else {}))
        print(f"using fused AdamW: {use_fused}")
        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model FLOPs utilisation: achieved FLOP/s over the peak of config.device_name.
        FLOPs per token from the PaLM paper, Appendix B (Chowdhery et al. 2022)."""
        N = self.get_num_params()
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return flops_per_iter / dt / PEAK_FLOPS[cfg.device_name]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens continuations of idx (LongTensor [b, t]), feeding each back in."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx



# ---------------------------------------------------------------------------------------------
# FSDP2 (--fsdp=True under torchrun): the model sharded over the ranks (its checkpoints: checkpoint.py)


def fully_shard_gpt(model, device_type, world_size, bf16_params=False):
    """
    Shard `model` in place with FSDP2's fully_shard over all `world_size` ranks, after broadcasting
    rank 0's weights: each block its own unit, then the root, which keeps wte and lm_head (tied: one
    parameter in one unit), wpe and ln_f. The per-example-norm buffers stay plain, unsharded,
    per-rank tensors (fully_shard shards parameters only), summed over ranks as under DDP.
    bf16_params: gather bfloat16 weights for compute, reduce gradients in float32. Build the
    optimizer afterwards, on the sharded parameters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # rank 0's weights everywhere first, as DDP does (each rank seeds its own: dropout differs by rank)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(t, src=0)
    kw = dict(mesh=init_device_mesh(device_type, (world_size,)))
    if bf16_params:
        kw['mp_policy'] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def grad_scaler(device_type, enabled, fsdp=False):
    """The loss scaler of a float16 run (`enabled`; a disabled one does nothing). FSDP: the sharded
    one, since a float16 overflow in one rank's shards must skip the step on every rank (found_inf
    all-reduced)."""
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device_type, enabled=enabled)
    return torch.amp.GradScaler(device_type, enabled=enabled)


def gradient_norm(params):
    """(the norm of the parameters' gradients, step_skipped of it): the step's norm, taken once, before
    GradScaler unscales (clip_unscaled divides its scale out), so that the GNS estimators, which read
    the gradients before unscaling, are handed the optimizer's decision."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm, step_skipped(norm)


def clip_unscaled(params, max_norm, norm, scaler):
    """Clip the unscaled gradients to max_norm (none when 0) with gradient_norm's norm, the loss scale (a
    power of 2, which divides exactly) divided out on the device; returns the unscaled norm."""
    if scaler.is_enabled():  # its scale a device tensor: get_scale() would read it
        scale = getattr(scaler, '_scale', None)
        norm = norm / (scale if isinstance(scale, torch.Tensor) else scaler.get_scale())
    if max_norm > 0.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def step_skipped(grad_norm):
    """The step's one decision, on the device: 1.0 when the gradients' norm is not finite (the
    optimizer skips the step, and the GNS estimators leave it out), else 0.0; a 0-dim float32 tensor."""
    norm = grad_norm.to_local() if hasattr(grad_norm, 'to_local') else grad_norm  # FSDP: a replicated DTensor
    return (~torch.isfinite(norm)).float()


def step_unless_nonfinite(optimizer, scaler, grad_norm, nonfinite_steps, skipped=None):
    """scaler.step(optimizer), unless the gradients' norm is not finite: GradScaler skips a float16
    overflow itself; in float32/bfloat16 a fused AdamW is told to skip through its found_inf, as
    GradScaler tells it, so the decision stays on the device and the step reads nothing (an optimizer
    that cannot skip on the device reads the norm). skipped: step_skipped(grad_norm), if already
    made. Returns the non-finite steps in a row, a 0-dim float32 tensor on the norm's device, given
    the count before this step (a number or that tensor)."""
    found_inf = step_skipped(grad_norm) if skipped is None else skipped
    if scaler.is_enabled():
        scaler.step(optimizer)
        return torch.zeros((), device=found_inf.device)
    # the groups decide, not optimizer.defaults: a loaded state brings its groups' own settings
    if all(group.get('fused') for group in optimizer.param_groups):
        optimizer.found_inf = found_inf  # fused AdamW leaves parameters, moments and step count as they were
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif found_inf.item() == 0:
        optimizer.step()
    return (nonfinite_steps + 1) * found_inf
