# The CPU demo (train_shakespeare_char_cpu.py: its data, size, schedule and measured layers) as a
# small Llama-style model: RMSNorm, a SwiGLU MLP, rotary position embeddings, an output head of
# its own and no biases. Trains on 2 CPU cores in a few minutes, like the demo.
import os

exec(open(os.path.join(os.path.dirname(__file__), 'train_shakespeare_char_cpu.py')).read())
out_dir = 'out-shakespeare-char-llama-cpu'
bias = False
norm = 'rmsnorm'
mlp = 'swiglu'
pos_emb = 'rope'
tie_embeddings = False
