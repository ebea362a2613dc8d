"""
What buffered.measure costs a model built elsewhere: Hugging Face's GPT2LMHeadModel (random
initialisation, offline) plain and measured, next to this repository's GPT of the same shape
built through layer_config as train.py builds it, all in one process and one run. Each iteration
is a training step: forward, backward, the exact estimator's measure_all where something is
measured, AdamW, zero_grad, reset_all. Settings take turns round by round, so that drift of a
shared machine hits every one alike.

Settings (measure()'s arguments, and the same layer flags for our GPT):
    nn        nothing measured: each model's baseline
    ln-shim   norm="shim" only: the LayerNorms (the paper's cheap setting)
    all-gns   linear="gns", embedding="gns", norm="shim": every parameter
    all-shim  linear="shim", embedding="shim", norm="shim": every parameter, torch's backward

--models picks the models (default: ours, hf-gpt2); the mixture-of-experts ones are Hugging Face's
tiny Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 of the same width and depth (4 experts, top-2;
Qwen3-MoE top-1; DeepSeek-V3 8 in 2 groups, its first layer dense) and our MoE GPT (--n_expert=4
--n_expert_active=2), every parameter measured by all-gns, each expert per expert.

Reported per (model, setting): median ms per iteration over every timed iteration, tokens/s, its
ratio to the same model's nn, and that ratio taken round by round (the median of each round's
ratio cancels drift between rounds). Needs transformers (pip install transformers).

    python bench/measure_hf.py
    python bench/measure_hf.py --n_layer 6 --n_embd 384 --n_head 6 --block_size 256 --batch_size 8 --csv hf.csv
    python bench/measure_hf.py --models ours-moe,hf-mixtral,hf-qwen2-moe,hf-qwen3-moe,hf-olmoe,hf-deepseek-v3 --settings nn,ln-shim,all-gns
"""
import argparse
import csv
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanogns.layers as buffered  # noqa: E402
import nanogns.estimators.exact as gnstracking  # noqa: E402
from nanogns.logread import ToolParser  # noqa: E402
from nanogns.layers.config import classes_for_flags, set_contextual_config  # noqa: E402
from nanogns.runlog import atomic_write  # noqa: E402

# setting -> measure()'s arguments; our GPT gets the same through train.py's layer flags
SETTINGS = {
    'nn': dict(linear=None, embedding=None, norm=None),
    'ln-shim': dict(linear=None, embedding=None, norm='shim'),
    'all-gns': dict(linear='gns', embedding='gns', norm='shim'),
    'all-shim': dict(linear='shim', embedding='shim', norm='shim'),
}
MODELS = ('ours', 'hf-gpt2')  # the default --models
# Hugging Face's MoE families: (config class, model class, options beyond the shared sizes), as MoE GPT's experts
MOE_FAMILIES = {
    'hf-mixtral': ('MixtralConfig', 'MixtralForCausalLM', lambda d: dict(intermediate_size=2 * d, num_local_experts=4,
                                                                        num_experts_per_tok=2)),
    'hf-qwen2-moe': ('Qwen2MoeConfig', 'Qwen2MoeForCausalLM', lambda d: dict(
        intermediate_size=2 * d, moe_intermediate_size=2 * d, shared_expert_intermediate_size=2 * d, num_experts=4,
        num_experts_per_tok=2)),
    'hf-qwen3-moe': ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM', lambda d: dict(
        intermediate_size=2 * d, moe_intermediate_size=2 * d, num_experts=4, num_experts_per_tok=1)),
    'hf-olmoe': ('OlmoeConfig', 'OlmoeForCausalLM', lambda d: dict(intermediate_size=2 * d, num_experts=4,
                                                                  num_experts_per_tok=2)),
    'hf-deepseek-v3': ('DeepseekV3Config', 'DeepseekV3ForCausalLM', lambda d: dict(
        intermediate_size=2 * d, moe_intermediate_size=d, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=d // 4, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16)),
}
ALL_MODELS = (*MODELS, 'ours-moe', *MOE_FAMILIES)
COLUMNS = ['model', 'setting', 'ms_median', 'tokens_per_s', 'ratio', 'ratio_by_round', 'ratio_min', 'ratio_max',
           'measured_params']


def build(model_name, setting, args):
    """(model, estimators) of one model and setting, the same weights for every setting of a model."""
    torch.manual_seed(0)
    values = SETTINGS[setting]
    if model_name in ('ours', 'ours-moe'):
        from model import GPT, GPTConfig
        flags = {f'{k}class' if k != 'norm' else 'lnclass': v or 'nn' for k, v in values.items()}
        moe = dict(n_expert=4, n_expert_active=2) if model_name == 'ours-moe' else {}
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                           vocab_size=args.vocab_size, dropout=0.0, bias=True, **moe)
        with set_contextual_config(**classes_for_flags(**flags)):
            model = GPT(config)
    elif model_name in MOE_FAMILIES:
        import transformers
        config_class, model_class, own = MOE_FAMILIES[model_name]
        d = args.n_embd
        config = getattr(transformers, config_class)(
            hidden_size=d, num_hidden_layers=args.n_layer, num_attention_heads=args.n_head, num_key_value_heads=args.n_head,
            vocab_size=args.vocab_size, max_position_embeddings=args.block_size, pad_token_id=0, bos_token_id=0,
            eos_token_id=0, **own(d))
        model = getattr(transformers, model_class)(config)
        if any(values.values()):
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                buffered.measure(model, **values)
    else:
        import transformers
        config = transformers.GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                         n_positions=args.block_size, vocab_size=args.vocab_size, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        if any(values.values()):
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')  # the coverage warning of ln-shim: the rest is left out on purpose
                buffered.measure(model, **values)
    model.train()
    measured = len(buffered.find_sqgradnorm_buffers(model))
    return model, gnstracking.estimators_for(model) if measured else [], measured


def loss_of(model_name, model, x):
    if model_name in ('ours', 'ours-moe'):
        return model(x, x.roll(-1, 1))[1]  # T tokens in, as Hugging Face's
    return model(input_ids=x, labels=x).loss  # the same T - 1 predictions, shifted inside


def timed_iterations(model_name, model, estimators, optimizer, batches):
    times = []
    for step, x in enumerate(batches):
        start = time.perf_counter()
        loss_of(model_name, model, x).backward()
        if estimators:
            gnstracking.measure_all(estimators, step, x.shape[0], None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gnstracking.reset_all(estimators)
        times.append(time.perf_counter() - start)
    return times


def write_csv(path, rows):
    """The whole table or nothing (tracker.atomic_write)."""
    def write(f):
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    atomic_write(path, write, mode='w')


def main(argv=None):
    parser = ToolParser(prog='bench/measure_hf.py', description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default in dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16, vocab_size=512,
                             iters=8, warmup=2, rounds=3, threads=0).items():
        parser.add_argument(f'--{key}', type=int, default=default)
    parser.add_argument('--settings', default=','.join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument('--models', default=','.join(MODELS), help=f"comma-separated, of {', '.join(ALL_MODELS)}")
    parser.add_argument('--csv', help='also write the table to this CSV file')
    args = parser.parse_args(argv)
    settings = args.settings.split(',')
    if any(s not in SETTINGS for s in settings) or 'nn' not in settings:
        parser.error(f"--settings must name some of {', '.join(SETTINGS)}, nn among them")
    models = args.models.split(',')
    if not models or any(m not in ALL_MODELS for m in models):
        parser.error(f"--models must name some of {', '.join(ALL_MODELS)}")
    if min(args.n_layer, args.n_head, args.n_embd, args.block_size, args.batch_size, args.vocab_size, args.iters,
           args.rounds) < 1 or args.warmup < 0 or args.threads < 0 or args.n_embd % args.n_head:
        parser.error("sizes, --iters and --rounds must be >= 1 (n_embd a multiple of n_head), --warmup and --threads >= 0")
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error("needs transformers (pip install transformers; requirements-dev.txt has it)")
    if args.threads:
        torch.set_num_threads(args.threads)

    runs = {}
    for name in models:
        for setting in settings:
            model, estimators, measured = build(name, setting, args)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            runs[name, setting] = dict(model=model, estimators=estimators, optimizer=optimizer, measured=measured,
                                       rounds=[])
    g = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.block_size)
    warm = [torch.randint(0, args.vocab_size, shape, generator=g) for _ in range(args.warmup)]
    for (name, setting), run in runs.items():
        timed_iterations(name, run['model'], run['estimators'], run['optimizer'], warm)
    print(f"{args.n_layer} layers x {args.n_embd}, {args.n_head} heads, block {args.block_size}, batch "
          f"{args.batch_size}, vocab {args.vocab_size}, {torch.get_num_threads()} threads; {args.rounds} rounds of "
          f"{args.iters} iterations of every (model, setting) in turn, after {args.warmup} warmup", flush=True)
    for _ in range(args.rounds):
        batches = [torch.randint(0, args.vocab_size, shape, generator=g) for _ in range(args.iters)]
        for (name, setting), run in runs.items():
            run['rounds'].append(timed_iterations(name, run['model'], run['estimators'], run['optimizer'], batches))

    rows = []
    tokens = args.batch_size * args.block_size  # tokens per iteration, alike for both models
    for (name, setting), run in runs.items():
        base = runs[name, 'nn']['rounds']
        median = statistics.median(t for r in run['rounds'] for t in r)
        base_median = statistics.median(t for r in base for t in r)
        by_round = [statistics.median(b) / statistics.median(r) for r, b in zip(run['rounds'], base)]
        rows.append(dict(model=name, setting=setting, ms_median=round(1000 * median, 3),
                         tokens_per_s=round(tokens / median, 1), ratio=round(base_median / median, 4),
                         ratio_by_round=round(statistics.median(by_round), 4), ratio_min=round(min(by_round), 4),
                         ratio_max=round(max(by_round), 4), measured_params=run['measured']))
    width = max(8, *(len(m) for m in models))
    print(f"{'model':<{width}} {'setting':<9} {'ms/iter':>8} {'tokens/s':>9} {'x nn':>6} {'by round':>9} {'range':>13} "
          f"{'measured':>8}")
    for r in rows:
        print(f"{r['model']:<{width}} {r['setting']:<9} {r['ms_median']:>8.1f} {r['tokens_per_s']:>9.0f} {r['ratio']:>6.3f} "
              f"{r['ratio_by_round']:>9.3f} {r['ratio_min']:>6.3f}-{r['ratio_max']:<6.3f} {r['measured_params']:>8}")
    print("x nn: tokens/s over the same model's nn (higher is faster); by round: the median of each round's ratio")
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")


if __name__ == '__main__':
    main()
