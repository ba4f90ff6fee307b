#!/usr/bin/env python3
"""The coefficients of the CPU's tanh (src/cpu/score.rs `tanh`): tanh(x) ~ x P(x^2) / Q(x^2)
on [0, X] with P of degree NP - 1 and Q of degree NQ in x^2 (Q's constant 1), minimising the
relative error by linearised least squares (P - tanh Q = 0 at Chebyshev-spaced points),
reweighted by the previous Q (Sanathanan-Koerner) until the error settles; in mpmath at 60
digits. Prints the largest relative error at the points per iteration, then P and Q.
Usage: scripts/fit-tanh.py (needs mpmath)."""
import mpmath as mp
mp.mp.dps = 60
NP, NQ, X = 7, 3, mp.mpf('9.1')
N = 600
xs = [X * (1 - mp.cos(mp.pi * (i + 0.5) / N)) / 2 for i in range(N)]  # dense near 0 and X
xs = [x for x in xs if x > mp.mpf('1e-4')]
ts = [mp.tanh(x) for x in xs]
qprev = [mp.mpf(1)] * len(xs)
for it in range(8):
    rows, rhs = [], []
    for x, t, qp in zip(xs, ts, qprev):
        w = 1 / (t * qp)
        x2 = x * x
        row = [w * x * x2**k for k in range(NP)] + [-w * t * x2**j for j in range(1, NQ + 1)]
        rows.append(row); rhs.append(w * t)
    A = mp.matrix(rows); b = mp.matrix(rhs)
    AtA = A.T * A; Atb = A.T * b
    c = mp.lu_solve(AtA, Atb)
    p = [c[k] for k in range(NP)]; q = [mp.mpf(1)] + [c[NP + j] for j in range(NQ)]
    def Q(x): return sum(q[j] * (x*x)**j for j in range(NQ + 1))
    def P(x): return x * sum(p[k] * (x*x)**k for k in range(NP))
    qprev = [Q(x) for x in xs]
    err = max(abs(P(x)/Q(x) - t)/t for x, t in zip(xs, ts))
    print(it, mp.nstr(err, 5))
print("P", [mp.nstr(v, 17) for v in p])
print("Q", [mp.nstr(v, 17) for v in q])
