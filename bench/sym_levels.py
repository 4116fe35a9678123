"""Which signed level set should symmetric InnerQ quantization use? Measures relative MSE per choice.

The InnerQ paper's symmetric formula (S = max|G| / (2^b - 1), signed codes) does not say which signed range
the b-bit codes cover. Candidates, all with one scale per group of G values and no zero-point:
  midtread : levels -(2^(b-1)-1) .. 2^(b-1)-1,   s = max|x| / (2^(b-1)-1)   (one code unused, no 1-bit form)
  midrise  : levels +-1/2, +-3/2, ..,           s = max|x| / ((2^b-1)/2)    (all codes, no zero level)
  twos     : levels -2^(b-1) .. 2^(b-1)-1,       s = max|x| / 2^(b-1)        (all codes, zero level, top clips)
Run: python bench/sym_levels.py   (CPU, ~10 s). The numbers are quoted in docs/FORMATS.md.
"""

import torch


def midtread(x, b):
    n = 2 ** (b - 1) - 1
    if n == 0:
        return None
    s = x.abs().amax(-1, keepdim=True) / n
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x / s).round().clamp(-n, n) * s


def midrise(x, b):
    n = (2**b - 1) / 2
    s = x.abs().amax(-1, keepdim=True) / n
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((x / s + n).round().clamp(0, 2**b - 1) - n) * s


def twos(x, b):
    n = 2 ** (b - 1)
    s = x.abs().amax(-1, keepdim=True) / n
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x / s).round().clamp(-n, n - 1) * s


def main(groups: int = 200_000, group_size: int = 32) -> None:
    torch.manual_seed(0)
    data = {
        "gaussian": torch.randn(groups, group_size),
        "laplace": torch.distributions.Laplace(0.0, 1.0).sample((groups, group_size)),
        "student-t(3)": torch.distributions.StudentT(3.0).sample((groups, group_size)),
    }
    print(f"relative MSE  E[(q(x)-x)^2] / E[x^2], groups of {group_size}, {groups} groups each")
    print(f"{'data':<13} {'bits':>4} {'midtread':>9} {'midrise':>9} {'twos':>9}  best")
    for name, x in data.items():
        for b in (1, 2, 3, 4):
            row = {}
            for f in (midtread, midrise, twos):
                y = f(x, b)
                row[f.__name__] = float("nan") if y is None else float(((y - x) ** 2).mean() / (x**2).mean())
            best = min((v, k) for k, v in row.items() if v == v)[1]
            print(f"{name:<13} {b:>4} {row['midtread']:>9.4f} {row['midrise']:>9.4f} {row['twos']:>9.4f}  {best}")


if __name__ == "__main__":
    main()
