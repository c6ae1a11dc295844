"""The statistics calibration fits on, summed over token batches so that memory does not grow with the data: medians
of per-token figures (exact up to a bound, then a seeded uniform sample), and the ridge refit of a linear write from
Gram matrices."""

import torch
from torch import nn


MEDIAN_SAMPLE = 65_536  # per-token figures kept for a median: beyond it, a uniform sample of this many
# times the mean diagonal of the write inputs' Gram matrix; chosen on held-out text (docs/experiments/calibration.md)
RIDGE = 1.0


class MedianSample:
    """Per-token figures whose median is wanted: all of them up to `bound`, then the `bound` with the smallest
    seeded random keys (a uniform sample without replacement)."""

    def __init__(self, bound: int = MEDIAN_SAMPLE, seed: int = 0):
        self.bound = bound
        self.generator = torch.Generator().manual_seed(seed)
        self.values, self.keys = torch.empty(0), torch.empty(0)

    def add(self, values: torch.Tensor) -> None:
        keys = torch.rand(values.numel(), generator=self.generator)
        self.values, self.keys = torch.cat([self.values, values.flatten().cpu()]), torch.cat([self.keys, keys])
        if len(self.values) > self.bound:
            kept = self.keys.topk(self.bound, largest=False).indices
            self.values, self.keys = self.values[kept], self.keys[kept]

    def median(self) -> float:
        return self.values.median().item()


def centred(states: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """States less their mean over features where `norm` removes it (LayerNorm)."""
    return states - states.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else states


def least_squares_ratios(stream: torch.Tensor, normalised: torch.Tensor) -> torch.Tensor:
    """Per row, the least-squares c in stream ~ c * normalised."""
    return (stream * normalised).sum(-1) / normalised.pow(2).sum(-1).clamp_min(1e-12)


class WriteFit:
    """Refits a linear write so that stream + write(inputs), as a reading `norm` sees it, lies along a target token by
    token, each token keeping the length that the write `unscaled` times a scale gives it (the scale is known only
    once every batch was seen; what the fit needs is linear in it).

    With s and t the centred stream and target, V the unscaled write on inputs X (a ones column for a bias):
    wanted = t <s + scale C(XV), t> / |t|^2 - s = a + scale b, and the fit needs X'X, X'a, X'b and the sums of a.a,
    a.b and b.b only."""

    def __init__(self, unscaled: torch.Tensor, norm: nn.Module):
        self.unscaled, self.norm = unscaled.double(), norm
        size, width = unscaled.shape
        self.gram = torch.zeros(size, size, dtype=torch.float64)
        self.towards = torch.zeros(2, size, width, dtype=torch.float64)  # X'a, X'b
        self.products = torch.zeros(3, dtype=torch.float64)  # a.a, a.b, b.b

    def add(self, inputs: torch.Tensor, stream: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch of rows (real tokens): the write's inputs, the stream it adds to, the target."""
        inputs = inputs.double()
        if len(self.unscaled) > inputs.shape[1]:  # a bias
            inputs = torch.cat([inputs, inputs.new_ones(len(inputs), 1)], dim=1)
        stream, target = centred(stream.double(), self.norm), centred(target.double(), self.norm)
        length = target.pow(2).sum(-1, keepdim=True).clamp_min(1e-12)
        a = target * (stream * target).sum(-1, keepdim=True) / length - stream
        b = target * (centred(inputs @ self.unscaled, self.norm) * target).sum(-1, keepdim=True) / length
        self.gram += inputs.T @ inputs
        self.towards += torch.stack([inputs.T @ a, inputs.T @ b])
        self.products += torch.stack([(a * a).sum(), (a * b).sum(), (b * b).sum()])

    def solve(self, scale: float) -> tuple[torch.Tensor, float, float]:
        """The write refitted from `scale` times the unscaled one (ridge towards it; the part the norm removes is
        kept), and the relative errors of the scaled and the refitted write."""
        current = scale * self.unscaled
        towards = self.towards[0] + scale * self.towards[1]
        wanted = self.products[0] + 2 * scale * self.products[1] + scale**2 * self.products[2]
        ridge = RIDGE * self.gram.diagonal().mean()
        prior = centred(current, self.norm)  # the part of the write that the norm sees
        factor = torch.linalg.cholesky(self.gram + ridge * torch.eye(len(self.gram), dtype=torch.float64))
        fitted = torch.cholesky_solve(towards + ridge * prior, factor) + current - prior

        def error(weights: torch.Tensor) -> float:
            seen = centred(weights, self.norm)  # |C(XW) - wanted|^2, wanted being centred
            squared = (seen * (self.gram @ seen)).sum() - 2 * (seen * towards).sum() + wanted
            return max(squared.item(), 0.0) / max(wanted.item(), 1e-12)

        return fitted, error(current), error(fitted)


def augmented(writer: nn.Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The write of `writer` as one matrix (in, out), its bias (plus `bias`) as a last row."""
    if writer.bias is None:
        return writer.weight.T
    return torch.cat([writer.weight.T, (writer.bias if bias is None else writer.bias + bias)[None]])


def set_write(writer: nn.Linear, write: torch.Tensor) -> None:
    """Sets `writer` to the matrix of `augmented`."""
    writer.weight.copy_(write[: writer.in_features].T)
    if writer.bias is not None:
        writer.bias.copy_(write[-1])
