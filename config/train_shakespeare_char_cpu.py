# A small character-level GPT that trains on 2 CPU cores in a few minutes, with every
# parameter's per-example gradient norm measured (the demo behind `make demo`).
out_dir = 'out-shakespeare-char-cpu'
eval_interval = 250
eval_iters = 20
log_interval = 10
always_save_checkpoint = True

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_tokens = 2000 * 12 * 64  # 2000 iterations
lr_decay_tokens = max_tokens
warmup_tokens = 100 * 12 * 64
min_lr = 1e-4
beta2 = 0.99

linearclass = 'gns'
embeddingclass = 'gns'
lnclass = 'shim'

device = 'cpu'
dtype = 'float32'
compile = False
device_name = 'M1_eflops'  # MFU against a laptop-class ceiling; CPUs have no datasheet bf16 peak
