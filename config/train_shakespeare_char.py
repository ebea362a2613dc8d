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

# baby GPT model :)
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # with baby networks can afford to go a bit higher
# nanoGPT's lengths, in nanoGPT's iterations: each counts the tokens of the step as finally configured,
# so nanoGPT's CPU command line (--batch_size=12 --block_size=64 --max_iters=2000 ...) warms up over
# 100 of its own iterations, as in nanoGPT (tokens fixed here would stretch it over 2133 of them)
max_iters = 5000
lr_decay_iters = 5000  # make equal to max_iters usually
min_lr = 1e-4  # learning_rate / 10 usually
beta2 = 0.99  # make a bit bigger because number of tokens per iter is small
warmup_iters = 100  # not super necessary potentially
