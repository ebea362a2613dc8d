# The paper's 111M-parameter Cerebras-GPT recipe on OpenWebText (Gray et al. 2024, following
# Dey et al. 2023): 10 layers, 12 heads, 768 wide, context 2048, ~2.22B tokens.
# python data/openwebtext/prepare.py
# torchrun --standalone --nproc_per_node=8 train.py config/train_cgpt_111M_owt.py
out_dir = 'out-cgpt-111M-owt'
eval_interval = 500
eval_iters = 100
log_interval = 1

wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'cgpt-111M'

dataset = 'openwebtext'
batch_size = 15
block_size = 2048
gradient_accumulation_steps = 8  # global: 15 * 8 * 2048 = 245,760 tokens per step; 1, 2, 4 or 8 GPUs

n_layer = 10
n_head = 12
n_embd = 768
dropout = 0.0
bias = True
cos_attn = [1]  # cosine attention in block 1

learning_rate = 1.17e-3
max_tokens = 2_220_000_000
warmup_tokens = 374_800_000
lr_decay_tokens = max_tokens
min_lr = 1.17e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

# measure every parameter; the fused LayerNorm kernel makes the LayerNorm part free
linearclass = 'gns'
embeddingclass = 'gns'
lnclass = 'fused'
