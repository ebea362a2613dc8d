# nanoGPT's "baby GPT" on character-level Shakespeare (a GPU run of a few minutes).
# python data/shakespeare_char/prepare.py && python train.py config/train_shakespeare_char.py
out_dir = 'out-shakespeare-char'
eval_interval = 250  # keep frequent because we'll overfit
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # only save when val improves

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # context of up to 256 previous characters
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # 16,384

# baby GPT model :)
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # with baby networks can afford to go a bit higher
max_tokens = 5000 * tokens_per_iter
lr_decay_tokens = max_tokens  # make equal to max_tokens usually
min_lr = 1e-4  # learning_rate / 10 usually
beta2 = 0.99  # make a bit bigger because number of tokens per iter is small
warmup_tokens = 100 * tokens_per_iter  # not super necessary potentially
del tokens_per_iter
