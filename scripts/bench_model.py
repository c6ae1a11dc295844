"""Throughput of NormSwap against Transformers' own BertModel and LlamaModel, same shapes and weights.

Prints tokens/s for a training step (forward + backward) and for inference, and the ratio NormSwap / native
(>= 1.0 means NormSwap is at least as fast). Runs are interleaved and the median of the repeats is reported.

    python scripts/bench_model.py                       # CPU, float32
    python scripts/bench_model.py --device cuda --dtype bfloat16 --hidden-size 1024 --layers 12 --batch-size 32
    python scripts/bench_model.py --autocast            # float32 weights under bfloat16 autocast (as --bf16 trains)
"""

import argparse
import statistics
import time

import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

from hf_normswap import NormSwapModel
from hf_normswap.convert.families import family_of, normswap_config


def converted(native) -> NormSwapModel:
    """The NormSwap model with the native model's weights (no swap)."""
    family = family_of(native.config)
    config = normswap_config(native.config, hidden_dropout=0.0, attention_dropout=0.0)
    state = {}
    for key, tensor in native.state_dict().items():
        name = family.rename(key)
        if name is not None and name.startswith("model."):
            state[name.removeprefix("model.")] = tensor
    model = NormSwapModel._from_config(config, attn_implementation=native.config._attn_implementation)
    model.load_state_dict(state, strict=True)
    return model.to(device=native.device, dtype=native.dtype)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tokens_per_second(model, input_ids, attention_mask, train: bool, args) -> float:
    model.train(train)
    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.autocast):
        for _ in range(2):
            step(model, input_ids, attention_mask, train)
        synchronize(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step(model, input_ids, attention_mask, train)
        synchronize(args.device)
    return args.steps * input_ids.numel() / (time.perf_counter() - start)


def step(model, input_ids, attention_mask, train: bool) -> None:
    if train:
        model.zero_grad(set_to_none=True)
        model(input_ids, attention_mask=attention_mask).last_hidden_state.float().pow(2).mean().backward()
    else:
        with torch.inference_mode():
            model(input_ids, attention_mask=attention_mask)


def compare(name, native, args) -> list[tuple[str, str, float, float, float]]:
    ours = converted(native)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, args.vocab_size, (args.batch_size, args.seq_length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[: args.batch_size // 2, -args.seq_length // 4 :] = 0
    input_ids, attention_mask = input_ids.to(args.device), attention_mask.to(args.device)
    with torch.no_grad():
        same = (
            native(input_ids, attention_mask=attention_mask).last_hidden_state.float()
            - ours(input_ids, attention_mask=attention_mask).last_hidden_state.float()
        )
    rows = []
    for mode, train in (("train step", True), ("inference", False)):
        native_runs, ours_runs = [], []
        for _ in range(args.repeats):
            native_runs.append(tokens_per_second(native, input_ids, attention_mask, train, args))
            ours_runs.append(tokens_per_second(ours, input_ids, attention_mask, train, args))
        native_speed, ours_speed = statistics.median(native_runs), statistics.median(ours_runs)
        rows.append((name, mode, native_speed, ours_speed, ours_speed / native_speed))
    print(f"{name}: max |difference| of last hidden states {same[attention_mask.bool()].abs().max().item():.2e}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--autocast", action="store_true", help="run under bfloat16 autocast (the weights' dtype kept)"
    )
    parser.add_argument("--attn-implementation", default="sdpa", choices=["eager", "sdpa"])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, help="default: 4 x hidden size")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shape = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate_size or 4 * args.hidden_size,
        max_position_embeddings=max(512, args.seq_length),
    )
    bert = BertModel._from_config(
        BertConfig(**shape, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        attn_implementation=args.attn_implementation,
        add_pooling_layer=False,
    )
    llama = LlamaModel._from_config(
        LlamaConfig(**shape, num_key_value_heads=max(1, args.heads // 4), pad_token_id=0),
        attn_implementation=args.attn_implementation,
    )
    rows = []
    for name, native in (
        ("BertModel (post, absolute, layernorm)", bert),
        ("LlamaModel (pre, rope, rmsnorm, SwiGLU, GQA)", llama),
    ):
        rows += compare(name, native.to(device=args.device, dtype=dtype), args)

    print(
        f"\ndevice={args.device} dtype={args.dtype} autocast={args.autocast} attn={args.attn_implementation} "
        f"hidden={args.hidden_size} "
        f"layers={args.layers} batch={args.batch_size} seq={args.seq_length} (median of {args.repeats})"
    )
    print(f"{'native model':46} {'mode':11} {'native tok/s':>13} {'normswap tok/s':>15} {'ratio':>6}")
    for name, mode, native_speed, ours_speed, ratio in rows:
        print(f"{name:46} {mode:11} {native_speed:13.0f} {ours_speed:15.0f} {ratio:6.3f}")


if __name__ == "__main__":
    main()
