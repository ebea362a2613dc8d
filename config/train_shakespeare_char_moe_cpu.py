# The CPU demo (train_shakespeare_char_cpu.py: its data, size, schedule and measured layers) as a small
# mixture-of-experts GPT: every MLP is 4 GELU experts and a router sending each token to 2 of them, with
# Switch's load-balancing loss. Every parameter's per-example gradient norm is measured, each expert's
# on its own (log.csv's <name>[e] columns; gns-analysis.py's experts and router groups).
import os

exec(open(os.path.join(os.path.dirname(__file__), 'train_shakespeare_char_cpu.py')).read())
out_dir = 'out-shakespeare-char-moe-cpu'
n_expert = 4
n_expert_active = 2
moe_aux_loss_coef = 0.01
