"""Mutation check: does a family's test suite fail when one line of its formulas is wrong?

    python -m quality.mutations [--family infinity_former] [--only 3,7] [--timeout 900] [--list]
                                [--make-test]

For each mutation of the chosen families (default: all), one line of a copy of the repository
(its tracked and untracked, not ignored, files, in a temporary directory) is replaced, and the
family's test files run there with pytest -x; the mutation is killed if a test fails (or the
run exceeds --timeout), survived if they all pass. The unmutated copy is run first and must
pass. Prints a markdown table (killed / survived, and the test that failed first) and a
summary line; the exit status is 1 if a mutation survived. With --make-test, only what
`make test` runs of the family's tests: its files in tests/unit and tests/integration, less
their `system` cases (the Triton kernels at the GPU's tile sizes).

A family is an entry of FAMILIES: (test files, mutations), each mutation a tuple (file, old
line, new line, description). Lines are compared without their indentation; the old line
must occur exactly once in the file, and the new line takes its indentation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

INFINITY = "pipeline/models/infinity_former/model.py"
ACTIVE_MEMORY = "pipeline/models/active_memory/model.py"
KERNELS = "pipeline/ops/triton_kernels.py"
LAUNCH = "pipeline/ops/triton_attention.py"

FAMILIES: dict[str, tuple[list[str], list[tuple[str, str, str, str]]]] = {
    "infinity_former": (
        # the attention's test first: it takes a second and kills its mutations at once
        [
            "tests/unit/models/test_infinity_attention.py",
            "tests/unit/models/test_infinity_formulas.py",
            "tests/unit/models/test_infinity_former.py",
            "tests/unit/models/test_infinity_precision.py",
        ],
        [
            (
                INFINITY,
                "return centres.repeat_interleave(len(widths)), sig.repeat(len(centres))",
                "return centres.repeat(len(widths)), sig.repeat_interleave(len(centres))",
                "basis laid out width-major instead of centre-major",
            ),
            (
                INFINITY,
                "return torch.exp(-0.5 * z * z) / (widths * math.sqrt(2 * math.pi))",
                "return torch.exp(-0.5 * z * z)",
                "basis functions not normalised",
            ),
            (
                INFINITY,
                "z = (t.unsqueeze(-1) - centres) / widths",
                "z = (t.unsqueeze(-1) - centres) / (widths * widths)",
                "basis divided by the variance instead of the width",
            ),
            (
                INFINITY,
                "return (k - 0.5) / n if midpoints else k / n",
                "return (k - 0.5) / n if midpoints else (k - 1) / n",
                "contraction grid at the cells' left ends",
            ),
            (
                INFINITY,
                "tau * contraction_grid(n_old, midpoints),",
                "contraction_grid(n_old, midpoints),",
                "old samples not contracted into [0, τ]",
            ),
            (
                INFINITY,
                "tau + (1 - tau) * contraction_grid(n_new, midpoints),",
                "tau + tau * contraction_grid(n_new, midpoints),",
                "new vectors spread over τ instead of 1 − τ",
            ),
            (
                INFINITY,
                "offsets = (torch.arange(pad, dtype=torch.float64) + 0.5) / total",
                "offsets = (torch.arange(pad, dtype=torch.float64) + 1.0) / total",
                "zero-padding positions shifted",
            ),
            (
                INFINITY,
                "gram = basis_t.T @ basis_t + ridge * torch.eye(len(centres), dtype=torch.float64)",
                "gram = basis_t.T @ basis_t + ridge ** 2 * torch.eye(len(centres), "
                "dtype=torch.float64)",
                "ridge penalty λ² instead of λ",
            ),
            (
                INFINITY,
                "return g[pad : len(positions) - pad]",
                "return g[: len(positions) - 2 * pad]",
                "fit matrix rows of the padding instead of the vectors",
            ),
            (
                INFINITY,
                "var = sigma_sq.unsqueeze(-1) + widths * widths",
                "var = sigma_sq.unsqueeze(-1) + widths",
                "closed-form read: basis width added as a variance",
            ),
            (
                INFINITY,
                "return torch.exp(-0.5 * diff * diff / var) / torch.sqrt(2 * math.pi * var)",
                "return torch.exp(-0.5 * diff * diff / var) / (2 * math.pi * var)",
                "closed-form read: normalised by the variance, not the standard deviation",
            ),
            (
                INFINITY,
                "z = (edges - mu.unsqueeze(-1)) / torch.sqrt(2 * sigma_sq).unsqueeze(-1)",
                "z = (edges - mu.unsqueeze(-1)) / torch.sqrt(sigma_sq).unsqueeze(-1)",
                "sticky histogram: erf without the √2",
            ),
            (
                INFINITY,
                "return mass / mass.sum(-1, keepdim=True)",
                "return mass",
                "sticky histogram not normalised",
            ),
            (
                INFINITY,
                "q = (torch.arange(n_samples, dtype=hist.dtype, device=hist.device) + 0.5) / "
                "n_samples",
                "q = (torch.arange(n_samples, dtype=hist.dtype, device=hist.device) + 1.0) / "
                "n_samples",
                "sticky quantile levels shifted",
            ),
            (
                INFINITY,
                "return (b + frac.clamp(0, 1)) / n_bins",
                "return (b + 0.5) / n_bins",
                "sticky positions at bin centres",
            ),
            (
                INFINITY,
                "ratio = sigma_sq / (sigma_0 * sigma_0)",
                "ratio = sigma_sq / sigma_0",
                "KL against σ0 instead of σ0²",
            ),
            (
                INFINITY,
                "return 0.5 * (ratio - torch.log(ratio) - 1)",
                "return 0.5 * (ratio - torch.log(ratio))",
                "KL without its −1",
            ),
            (
                INFINITY,
                "new = torch.sigmoid(self.gate(new.transpose(1, 2))).transpose(1, 2) * new",
                "new = self.gate(new.transpose(1, 2)).transpose(1, 2) * new",
                "gate without its sigmoid",
            ),
            (
                INFINITY,
                "u = sticky_positions(hist.to(self.centres.dtype), n)",
                "u = contraction_grid(n, self.cfg.contraction_midpoints).to(self.centres)",
                "sticky histogram ignored",
            ),
            (
                INFINITY,
                "samples = basis_values(u, self.centres, self.widths) @ "
                "coeff.to(self.centres.dtype)",
                "samples = basis_values(self.cfg.tau * u, self.centres, self.widths) "
                "@ coeff.to(self.centres.dtype)",
                "old signal sampled at the contracted positions",
            ),
            (
                INFINITY,
                "new = torch.cat([self.old_samples(coeff, hist), new], 1)",
                "new = torch.cat([new, self.old_samples(coeff, hist)], 1)",
                "old samples and new vectors swapped in the refit",
            ),
            (
                INFINITY,
                "keys = self.key(coeff).view(bsz, n, n_heads, d_head).transpose(1, 2)",
                "keys = self.value(coeff).view(bsz, n, n_heads, d_head).transpose(1, 2)",
                "keys from the value map",
            ),
            (
                INFINITY,
                "values = self.value(coeff).view(bsz, n, n_heads, d_head).transpose(1, 2)",
                "values = self.value(coeff).view(bsz, n_heads, n, d_head)",
                "values split into heads the wrong way",
            ),
            (
                INFINITY,
                "scores = q @ keys.transpose(-1, -2) / math.sqrt(d_head)  # [B, H, M, N]",
                "scores = q @ keys.transpose(-1, -2)",
                "no 1/sqrt(d_head) on the scores",
            ),
            (
                INFINITY,
                "sigma_logit = F.linear(scores, self.sigma.weight.to(scores.dtype)).squeeze(-1)",
                "sigma_logit = F.linear(scores, self.mu.weight.to(scores.dtype)).squeeze(-1)",
                "σ² from μ's weights",
            ),
            (INFINITY, "mu = torch.sigmoid(mu_logit)", "mu = mu_logit", "μ without its sigmoid"),
            (
                INFINITY,
                "sigma_sq = F.softplus(sigma_logit).clamp(min=MIN_SIGMA_SQ)",
                "sigma_sq = torch.exp(sigma_logit).clamp(min=MIN_SIGMA_SQ)",
                "exp instead of softplus for σ²",
            ),
            (
                INFINITY,
                "sigma_sq = F.softplus(sigma_logit).clamp(min=MIN_SIGMA_SQ)",
                "sigma_sq = F.softplus(sigma_logit)",
                "σ² clamp removed",
            ),
            (
                INFINITY,
                "return self.out(z), mu, sigma_sq",
                "return z, mu, sigma_sq",
                "LTM read without its output map",
            ),
            (
                INFINITY,
                "ltm_out, *read = self.ltm(*ltm_in, q)",
                "ltm_out, *read = self.ltm(*ltm_in, k[:, :, c:])",
                "LTM read with the block's keys instead of its queries",
            ),
            (
                INFINITY,
                "intake_rows = slice(taken - seen + c, c - cfg.mem_len)",
                "intake_rows = slice(c - cfg.mem_len - m, c - cfg.mem_len)",
                "LTM intake: the current block's length instead of what left the STM",
            ),
            (
                INFINITY,
                "kls.append(kl_variance(sigma_sq, cfg.sigma_0).mean())",
                "kls.append(kl_variance(sigma_sq, cfg.sigma_0).sum())",
                "KL summed over queries and heads instead of averaged",
            ),
            # the short-term attention (Transformer-XL's relative attention over the STM)
            (
                INFINITY,
                "scores = (content + position) / math.sqrt(dh)",
                "scores = content + position",
                "short-term attention: no 1/sqrt(d_head)",
            ),
            (
                INFINITY,
                "scores = (content + position) / math.sqrt(dh)",
                "scores = (content + position) / math.sqrt(d)",
                "short-term attention: 1/sqrt(d_model) instead of 1/sqrt(d_head)",
            ),
            (
                INFINITY,
                "scores = (content + position) / math.sqrt(dh)",
                "scores = (content + position) / dh",
                "short-term attention: 1/d_head (the sqrt dropped)",
            ),
            (
                INFINITY,
                "scores = (content + position) / math.sqrt(dh)",
                "scores = content / math.sqrt(dh)",
                "short-term attention: position term dropped",
            ),
            (
                INFINITY,
                "scores = (content + position) / math.sqrt(dh)",
                "scores = (content - position) / math.sqrt(dh)",
                "short-term attention: position term's sign flipped",
            ),
            (
                INFINITY,
                "position = by_dist.gather(-1, dist.clamp(min=0).expand(bsz, h, m, c + m))",
                "position = by_dist.gather(-1, (dist - 1).clamp(min=0).expand(bsz, h, m, c + m))",
                "short-term attention: key at distance δ gets the embedding of δ − 1",
            ),
            (
                INFINITY,
                "position = by_dist.gather(-1, dist.clamp(min=0).expand(bsz, h, m, c + m))",
                "position = by_dist.gather(-1, (dist + 1).clamp(min=0, max=c + m - 1)"
                ".expand(bsz, h, m, c + m))",
                "short-term attention: key at distance δ gets the embedding of δ + 1",
            ),
            (
                INFINITY,
                "by_dist = (q + self.position_bias.unsqueeze(1)) @ rel.transpose(-1, -2)",
                "by_dist = (q + self.content_bias.unsqueeze(1)) @ rel.transpose(-1, -2)",
                "short-term attention: position term with the content bias",
            ),
            (
                INFINITY,
                "content = (q + self.content_bias.unsqueeze(1)) @ k.transpose(-1, -2)",
                "content = q @ k.transpose(-1, -2)",
                "short-term attention: content bias dropped",
            ),
            (
                INFINITY,
                "rel = self.pos(pos_emb.to(x.dtype))",
                "rel = pos_emb.to(x.dtype)",
                "short-term attention: position embeddings without their map W_R",
            ),
            (
                INFINITY,
                "return torch.cat([angles.sin(), angles.cos()], -1)",
                "return torch.cat([angles.cos(), angles.sin()], -1)",
                "relative position sinusoid: cosines first",
            ),
            (
                INFINITY,
                "sinusoid(torch.arange(cfg.mem_len + m, device=tokens.device), cfg.d_model)",
                "sinusoid(torch.arange(1, cfg.mem_len + m + 1, device=tokens.device), cfg.d_model)",
                "position embeddings of distances 1.. instead of 0..",
            ),
            (
                INFINITY,
                "masked = (dist < 0) | (keys_at < c - n_valid)",
                "masked = dist < 0",
                "short-term attention: cache rows without states not masked",
            ),
            (
                INFINITY,
                "masked = (dist < 0) | (keys_at < c - n_valid)",
                "masked = (dist < 0) | (keys_at < c - n_valid - 1)",
                "memory mask off by one: the last row without a state is read",
            ),
            (
                INFINITY,
                "masked = (dist < 0) | (keys_at < c - n_valid)",
                "masked = (dist < 0) | (keys_at <= c - n_valid)",
                "memory mask off by one: the first valid row is masked",
            ),
            (
                INFINITY,
                "masked = (dist < 0) | (keys_at < c - n_valid)",
                "masked = (dist < -1) | (keys_at < c - n_valid)",
                "causal mask off by one: each query reads the next key",
            ),
            (
                INFINITY,
                "n_valid = min(seen, cfg.mem_len)  # the STM: the cache's last n_valid rows",
                "n_valid = cfg.mem_len",
                "the STM counted full from a document's start (its empty rows read)",
            ),
        ],
    ),
    "active_memory": (
        ["tests/unit/models/test_active_memory.py"],
        [
            # the hard sigmoid: highway gate, CGRU gates
            (
                ACTIVE_MEMORY,
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
                "return torch.clamp(1.0 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
                "hard sigmoid: slope 1.2 -> 1.0",
            ),
            (
                ACTIVE_MEMORY,
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.2, 0.0, 1.0)",
                "hard sigmoid: offset -0.1 -> -0.2",
            ),
            (
                ACTIVE_MEMORY,
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.1)",
                "hard sigmoid: no upper clip (1.2 sigmoid - 0.1 tops out at 1.1)",
            ),
            (
                ACTIVE_MEMORY,
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
                "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, -0.1, 1.0)",
                "hard sigmoid: no lower clip (bottoms out at -0.1)",
            ),
            # the convolution every operator uses
            (
                ACTIVE_MEMORY,
                "padded = torch.cat([left.expand(b, -1, -1), x, right.expand(b, -1, -1)], dim=1)",
                "padded = torch.cat([right.expand(b, -1, -1), x, left.expand(b, -1, -1)], dim=1)",
                "conv: left and right padding blocks swapped",
            ),
            (
                ACTIVE_MEMORY,
                "return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)",
                "return F.conv1d(padded.transpose(1, 2), self.weight).transpose(1, 2)",
                "conv: bias dropped",
            ),
            (
                ACTIVE_MEMORY,
                "return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)",
                "return F.conv1d(padded.transpose(1, 2), self.weight.flip(-1), "
                "self.bias).transpose(1, 2)",
                "conv: taps reversed (correlation -> convolution)",
            ),
            (
                ACTIVE_MEMORY,
                "return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)",
                "return F.conv1d(padded.transpose(1, 2), self.weight.transpose(0, 1), "
                "self.bias).transpose(1, 2)",
                "conv: input and output channels swapped",
            ),
            (
                ACTIVE_MEMORY,
                "return (k - 1, 0) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)",
                "return (k - 1, 0) if self.causal else (k - 1 - (k - 1) // 2, (k - 1) // 2)",
                "same padding: left and right row counts swapped",
            ),
            (
                ACTIVE_MEMORY,
                "return (k - 1, 0) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)",
                "return (0, k - 1) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)",
                "causal padding on the right",
            ),
            # conv and persistent-conv
            (
                ACTIVE_MEMORY,
                'return F.relu(y) if self.relu else F.gelu(y, approximate="tanh")',
                "return F.relu(y) if self.relu else F.gelu(y)",
                "conv: exact (erf) GELU instead of the code's tanh approximation",
            ),
            (
                ACTIVE_MEMORY,
                'self.relu = cfg.conv_activation == "relu"',
                'self.relu = cfg.conv_activation != "relu"',
                "conv: activation option inverted",
            ),
            (
                ACTIVE_MEMORY,
                "left, right = self.persistent_padding.left, self.persistent_padding.right",
                "left, right = self.persistent_padding.right, self.persistent_padding.left",
                "persistent-conv: trainable blocks swapped",
            ),
            # highway-convolution
            (
                ACTIVE_MEMORY,
                "b = hard_sigmoid(self.gate(x, left, right))",
                "b = torch.sigmoid(self.gate(x, left, right))",
                "highway: sigmoid gate instead of the hard sigmoid",
            ),
            (
                ACTIVE_MEMORY,
                "b = hard_sigmoid(self.gate(x, left, right))",
                "b = hard_sigmoid(self.transform(x, left, right))",
                "highway: gate from the transform's convolution",
            ),
            (
                ACTIVE_MEMORY,
                "return a * b + x * (1 - b)",
                "return a * (1 - b) + x * b",
                "highway: transform and carry gates swapped",
            ),
            (
                ACTIVE_MEMORY,
                "return a * b + x * (1 - b)",
                "return a * b + x",
                "highway: carry not gated",
            ),
            # CGRU
            (
                ACTIVE_MEMORY,
                'self.gate = hard_sigmoid if cfg.cgru_gate == "hard_sigmoid" else torch.sigmoid',
                'self.gate = torch.sigmoid if cfg.cgru_gate == "hard_sigmoid" else hard_sigmoid',
                "CGRU: gate option inverted",
            ),
            (
                ACTIVE_MEMORY,
                "r = self.gate(self.reset(x, left, right))",
                "r = self.gate(self.update(x, left, right))",
                "CGRU: reset gate from the update gate's convolution",
            ),
            (
                ACTIVE_MEMORY,
                "return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))",
                "return u * x + (1 - u) * torch.tanh(self.candidate(x, left, right))",
                "CGRU: reset gate not applied",
            ),
            (
                ACTIVE_MEMORY,
                "return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))",
                "return (1 - u) * x + u * torch.tanh(self.candidate(r * x, left, right))",
                "CGRU: update gate on the wrong term",
            ),
            (
                ACTIVE_MEMORY,
                "return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))",
                "return u * x + (1 - u) * torch.sigmoid(self.candidate(r * x, left, right))",
                "CGRU: sigmoid candidate instead of tanh",
            ),
            # the attention branch
            (
                ACTIVE_MEMORY,
                "self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -0.5)",
                "self.scale = cfg.head_dim ** (-1.0 if cfg.attn_double_scale else -0.5)",
                "attention: the code's scale d_h^-1.0 instead of d_h^-1.5",
            ),
            (
                ACTIVE_MEMORY,
                "self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -0.5)",
                "self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -1.0)",
                "attention: the standard scale d_h^-1.0 instead of d_h^-0.5",
            ),
            (
                ACTIVE_MEMORY,
                "future = torch.ones(m, m, dtype=torch.bool, device=x.device).triu(1)",
                "future = torch.ones(m, m, dtype=torch.bool, device=x.device).triu(2)",
                "attention: causal mask lets each position see the next one",
            ),
            (
                ACTIVE_MEMORY,
                "weights = self.dropout(torch.softmax(logits, dim=-1))",
                "weights = self.dropout(torch.softmax(logits, dim=-2))",
                "attention: softmax over queries instead of keys",
            ),
            (
                ACTIVE_MEMORY,
                "return self.out((weights @ v).transpose(1, 2).reshape(b, m, -1))",
                "return self.out((weights.transpose(-1, -2) @ v).transpose(1, 2).reshape(b, m, "
                "-1))",
                "attention: weights transposed",
            ),
            # the sa+X sums
            (
                ACTIVE_MEMORY,
                "mixed = mixed + self.attention(y)",
                "mixed = self.attention(y)",
                "sa+X: operator output dropped from the sum",
            ),
            (
                ACTIVE_MEMORY,
                "mixed = mixed + self.attention(y)",
                "mixed = mixed + self.attention(x)",
                "sa+X: attention on the un-normalised input",
            ),
            (
                ACTIVE_MEMORY,
                "mixed = self.operator(y, left, right) if self.operator is not None else 0",
                "mixed = self.operator(x, left, right) if self.operator is not None else 0",
                "operator on the un-normalised input",
            ),
            (
                ACTIVE_MEMORY,
                "mixed = mixed + self.attention(y)",
                "mixed = mixed - self.attention(y)",
                "sa+X: attention subtracted",
            ),
            # the block around the mixer
            (
                ACTIVE_MEMORY,
                "x = layer(x + timing, left, right)",
                "x = layer(x, left, right)",
                "timing signal not added again at every layer",
            ),
            (
                ACTIVE_MEMORY,
                "signal = torch.cat([torch.sin(t), torch.cos(t)], dim=1)",
                "signal = torch.cat([torch.cos(t), torch.sin(t)], dim=1)",
                "timing signal: cos channels first",
            ),
            (
                ACTIVE_MEMORY,
                "x = self.embedding(tokens) * math.sqrt(d)",
                "x = self.embedding(tokens)",
                "embedding not scaled by sqrt(d)",
            ),
            (
                ACTIVE_MEMORY,
                "y = self.ff_out(self.dropout(F.relu(self.ff_in(self.ff_norm(x)))))",
                "y = self.ff_out(self.dropout(F.relu(self.ff_in(x))))",
                "feed-forward on the un-normalised input",
            ),
        ],
    ),
    "triton_attention": (
        ["tests/unit/ops/test_attention_triton.py"],
        [
            # scale
            (
                LAUNCH,
                "1.4426950408889634 / math.sqrt(d), 1.0 / math.sqrt(d), 1.0 / (1.0 - dropout_p),",
                "1.4426950408889634 / d, 1.0 / math.sqrt(d), 1.0 / (1.0 - dropout_p),",
                "scores scaled by 1/d_h instead of 1/sqrt(d_h)",
            ),
            (
                LAUNCH,
                "1.4426950408889634 / math.sqrt(d), 1.0 / math.sqrt(d), 1.0 / (1.0 - dropout_p),",
                "1.4426950408889634 / math.sqrt(d), 1.0 / d, 1.0 / (1.0 - dropout_p),",
                "dq, dk and the persistent keys' gradient scaled by 1/d_h",
            ),
            (
                KERNELS,
                "return tl.dot(q, tl.trans(k_tile), input_precision=PREC) * qk_scale2 + bias",
                "return tl.dot(q, tl.trans(k_tile), input_precision=PREC) + bias",
                "content score q.k not scaled",
            ),
            (
                KERNELS,
                "return tl.dot(q, tl.trans(u), input_precision=PREC) * qk_scale2 + row[None, :]",
                "return tl.dot(q, tl.trans(u), input_precision=PREC) + row[None, :]",
                "position term q.u not scaled",
            ),
            # position index
            (
                KERNELS,
                "at = (tt - rr + T) % T",
                "at = (tt - rr + T + 1) % T",
                "position term gathered one distance off",
            ),
            (
                KERNELS,
                "bias = tl.where(tt >= rr, tl.gather(bias_cur, at, 1), "
                "tl.gather(bias_prev, at, 1))",
                "bias = tl.where(tt > rr, tl.gather(bias_cur, at, 1), tl.gather(bias_prev, at, 1))",
                "a tile's diagonal read from the previous distance chunk",
            ),
            (
                KERNELS,
                "return tl.load(pos_ptr + col[:, None] * stride_pj + dd[None, :] * stride_pd, "
                "mask=ok, other=0.0)",
                "return tl.load(pos_ptr + (col[:, None] + 1) * stride_pj "
                "+ dd[None, :] * stride_pd, mask=ok, other=0.0)",
                "u read one column off",
            ),
            # window edge
            (
                KERNELS,
                'row = tl.where((jj >= 0) & (jj < L), 0.0, float("-inf"))',
                'row = tl.where((jj >= 0) & (jj <= L), 0.0, float("-inf"))',
                "window one key too long (the query's own position)",
            ),
            (
                KERNELS,
                'row = tl.where((jj >= 0) & (jj < L), 0.0, float("-inf"))',
                'row = tl.where((jj >= 1) & (jj < L), 0.0, float("-inf"))',
                "window one key too short (the oldest key left out)",
            ),
            (
                KERNELS,
                "for k in range(0, (L + T - 2) // T + 1):  # the window's tiles",
                "for k in range(0, (L + T - 2) // T):  # the window's tiles",
                "forward: the window's last tile left out",
            ),
            # span mask
            (
                KERNELS,
                "mask = tl.load(mask_row + j, mask=(j >= 0) & (j < L), other=0.0)",
                "mask = tl.load(mask_row + j + 1, mask=(j >= 0) & (j < L - 1), other=0.0)",
                "span mask read one distance off",
            ),
            (
                KERNELS,
                "p = p * mask",
                "p = p",
                "forward: the span mask not applied to the weights",
            ),
            (
                KERNELS,
                "p = e * mask",
                "p = e",
                "backward: the span mask not applied to the weights",
            ),
            # the reference's +1e-8 renormalisation guard
            (
                LAUNCH,
                "keep_threshold(dropout_p), 0.0 if mask is None else RENORM_EPS,",
                "keep_threshold(dropout_p), 0.0,",
                "the +1e-8 guard left out (the log m formulation's weights)",
            ),
            (
                KERNELS,
                "e_i = e_i * alpha + tl.sum(p, 1)",
                "e_i = e_i + tl.sum(p, 1)",
                "the guard's sum of every key not rescaled by the new maximum",
            ),
            (
                KERNELS,
                "denominator += renorm_eps * e_i",
                "denominator += renorm_eps * l_i",
                "the guard scaled by the masked weights' sum, not every key's",
            ),
            (
                KERNELS,
                "ds -= (renorm_eps * delta)[:, None] * e  # every key's share of the eps term",
                "ds -= (renorm_eps * delta)[:, None] * p  # every key's share of the eps term",
                "backward: the guard's share taken from the masked weights",
            ),
            (
                KERNELS,
                "return p_dropped, ds, e * dp_centred",
                "return p_dropped, ds, p * dp_centred",
                "m's gradient from the masked weights (none at the ramp's edge, where m = 0)",
            ),
            # online softmax
            (
                KERNELS,
                "alpha = tl.math.exp2(m_i - m_new)",
                "alpha = tl.math.exp2(m_new - m_i)",
                "online softmax rescales the wrong way",
            ),
            (
                KERNELS,
                "l_i = l_i * alpha + tl.sum(p, 1)",
                "l_i = l_i + tl.sum(p, 1)",
                "running sum not rescaled by the new maximum",
            ),
            (
                KERNELS,
                "tl.store(lse_ptr + bh * M + rows, m_i + tl.math.log2(denominator), mask=row_ok)",
                "tl.store(lse_ptr + bh * M + rows, m_i, mask=row_ok)",
                "log-sum-exp without log l: the backward's weights unnormalised",
            ),
            # dropout
            (
                LAUNCH,
                "1.4426950408889634 / math.sqrt(d), 1.0 / math.sqrt(d), 1.0 / (1.0 - dropout_p),",
                "1.4426950408889634 / math.sqrt(d), 1.0 / math.sqrt(d), 1.0,",
                "kept weights not scaled by 1 / (1 - p) anywhere",
            ),
            (
                KERNELS,
                "out = acc * (keep_scale / denominator)[:, None]",
                "out = acc * (1.0 / denominator)[:, None]",
                "forward: kept weights not scaled by 1 / (1 - p)",
            ),
            (
                KERNELS,
                "dp = tl.where(keep, dp * keep_scale, 0.0)",
                "dp = tl.where(keep, dp, 0.0)",
                "backward: dP of the kept weights not scaled",
            ),
            (
                KERNELS,
                "p_dropped = tl.where(keep, p * keep_scale, 0.0)",
                "p_dropped = tl.where(keep, p, 0.0)",
                "dv and dpv from unscaled kept weights",
            ),
            (
                KERNELS,
                "p = tl.where(_keep(seed, b, h, rows[:, None], key, threshold, T), p, 0.0)",
                "p = tl.where(_keep(seed, b, h, rows[:, None], key + 1, threshold, T), p, 0.0)",
                "forward: dropout drawn at the wrong key coordinate",
            ),
            (
                KERNELS,
                "return i0 + k * T + tl.arange(0, T)[None, :]",
                "return i0 + k * T + tl.arange(0, T)[None, :] + 1",
                "dropout's key coordinate one off",
            ),
            (
                KERNELS,
                "x = (x ^ (x >> 13)) * 0xC2B2AE35",
                "x = (x ^ (x >> 12)) * 0xC2B2AE35",
                "dropout hash: a finaliser shift changed",
            ),
            (
                KERNELS,
                "bits = tl.where((c & 1) == 1, both >> 16, both & 0xFFFF)",
                "bits = both & 0xFFFF",
                "dropout: both keys of a pair read the same 16 bits of their hash",
            ),
            # gradients
            (
                KERNELS,
                "dp_centred = dp - delta[:, None]",
                "dp_centred = dp",
                "dS without the row term delta",
            ),
            (
                LAUNCH,
                "delta = (grad.float() * out.float()).sum(-1)  # sum_c P dP per row = dO . O",
                "delta = grad.float().sum(-1)  # sum_c P dP per row = dO . O",
                "delta is not dO . O",
            ),
            (
                KERNELS,
                "dq += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision=PREC)",
                "dq += tl.dot(ds.to(k_tile.dtype), v_tile, input_precision=PREC)",
                "dq: content part from the values",
            ),
            (
                KERNELS,
                "dq += tl.dot(d_done, u_prev, input_precision=PREC)",
                "dq += tl.dot(d_done, u, input_precision=PREC)",
                "dq: position part from the wrong distance chunk",
            ),
            (
                KERNELS,
                "later = cols[None, :] + rr < T  # ... of this tile's chunk k "
                "(else of chunk k - 1)",
                "later = cols[None, :] + rr <= T  # ... of this tile's chunk k "
                "(else of chunk k - 1)",
                "backward: a distance column put in the wrong chunk",
            ),
            (
                KERNELS,
                "done_sums += tl.sum(tl.where(later, 0.0, dm_by_distance), 0)",
                "done_sums += 0.0",
                "m's gradient loses a chunk's part from the next tile",
            ),
            (
                LAUNCH,
                "dpos = (du.sum((0, 1))[:span_len] * scale).t().contiguous().to(pos.dtype)",
                "dpos = du.sum((0, 1))[:span_len].t().contiguous().to(pos.dtype)",
                "u's gradient not scaled by 1/sqrt(d_h)",
            ),
            (
                LAUNCH,
                "dmask_parts.view(b, h, -1, dmask_parts.shape[-1]).sum((0, 2))[:, :span_len]"
                ".contiguous()",
                "dmask_parts.view(b, h, -1, dmask_parts.shape[-1])"
                ".sum((0, 2))[:, 1 : span_len + 1].contiguous()",
                "m's gradient one distance off",
            ),
            (
                KERNELS,
                "first = tl.maximum(c0 - L + 1, 0) // T * T",
                "first = tl.maximum(c0 - L + 1, 0) // T * T + T",
                "dk, dv miss the first query block that reaches their tile",
            ),
            (
                KERNELS,
                "dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)",
                "dk += tl.dot(tl.trans(p).to(q.dtype), q, input_precision=PREC)",
                "dk from the weights instead of dS",
            ),
            (
                KERNELS,
                "dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)",
                "dv += tl.dot(tl.trans(ds).to(do.dtype), do, input_precision=PREC)",
                "dv from dS instead of the weights",
            ),
            (
                KERNELS,
                "dpk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)",
                "dpk += tl.dot(tl.trans(ds).to(q.dtype), do, input_precision=PREC)",
                "persistent keys' gradient from dO instead of q",
            ),
            (
                KERNELS,
                "dpv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)",
                "dpv += tl.dot(tl.trans(p).to(do.dtype), q, input_precision=PREC)",
                "persistent values' gradient from q instead of dO",
            ),
            (
                KERNELS,
                "for b in range(0, B):",
                "for b in range(0, 1):",
                "persistent gradients summed over the first batch element only",
            ),
            (
                KERNELS,
                "tl.store(dpk_ptr + h * N * D + pers[:, None] * D + dd[None, :], dpk * sm_scale, "
                "mask=p_ok)",
                "tl.store(dpk_ptr + h * N * D + pers[:, None] * D + dd[None, :], dpk, mask=p_ok)",
                "persistent keys' gradient not scaled by 1/sqrt(d_h)",
            ),
            (
                KERNELS,
                "ok = (rows[:, None] < M) & (dd[None, :] < D)",
                "ok = dd[None, :] < D",
                "backward: query rows past M not zeroed",
            ),
        ],
    ),
}


def copy_repository(dest: Path) -> None:
    """The tracked and the untracked, not ignored, files of the repository, into dest."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def mutate(text: str, old: str, new: str) -> str:
    """text with its one line equal to ``old`` (indentation aside) replaced by ``new``."""
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == old.strip()]
    if len(hits) != 1:
        raise SystemExit(f"mutation line found {len(hits)} times (expected once): {old!r}")
    line = lines[hits[0]]
    lines[hits[0]] = line[: len(line) - len(line.lstrip())] + new.strip()
    return "\n".join(lines)


def line_number(text: str, old: str) -> int:
    return next(i for i, line in enumerate(text.split("\n"), 1) if line.strip() == old.strip())


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[bool, str]:
    """(passed, the first failing test or why) for pytest -x over ``tests`` in the copy."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:g} s"
    if done.returncode == 0:
        return True, ""
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return False, (failed[0].split(" - ")[0] if failed else done.stdout.strip()[-200:])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--family",
        action="append",
        choices=sorted(FAMILIES),
        help="a family to check (repeatable; default: all)",
    )
    ap.add_argument("--only", help="comma-separated mutation numbers (1-based, per family)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    ap.add_argument("--list", action="store_true", help="list the mutations and stop")
    ap.add_argument(
        "--make-test",
        action="store_true",
        help="only what `make test` runs of the family's tests (unit and integration tiers)",
    )
    return ap.parse_args(argv)


FAST_TIERS = ("tests/unit/", "tests/integration/")


def selected_tests(family: str, make_test: bool) -> list[str]:
    """pytest's arguments for a family: its test files, or with ``make_test`` those of the
    fast tiers less their system cases."""
    tests = FAMILIES[family][0]
    if not make_test:
        return tests
    return ["-m", "not system", *(t for t in tests if t.startswith(FAST_TIERS))]


def check_copy(copy: Path) -> None:
    """The copy must import its own pipeline/, or every mutation would look survived."""
    where = subprocess.run(
        [sys.executable, "-c", "import pipeline; print(pipeline.__file__)"],
        cwd=copy,
        env=dict(os.environ, PYTHONPATH=str(copy)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy imports pipeline from {where}, not from itself")


def check_family(
    copy: Path, family: str, only: set[int] | None, timeout: float, make_test: bool = False
) -> int:
    """Run one family's mutations in ``copy``, a table row each; how many survived."""
    mutations = FAMILIES[family][1]
    tests = selected_tests(family, make_test)
    start = time.perf_counter()
    ok, why = run_tests(copy, tests, timeout)
    if not ok:
        raise SystemExit(f"{family}: the unmutated tests fail ({why})")
    print(
        f"## {family}: {len(mutations)} mutations; tests: {' '.join(tests)} "
        f"(unmutated: pass, {time.perf_counter() - start:.0f} s)\n"
    )
    print("| # | where | mutation | result | failed first |")
    print("|---:|---|---|---|---|")
    killed = survived = 0
    for k, (file, old, new, what) in enumerate(mutations, 1):
        if only is not None and k not in only:
            continue
        path = copy / file
        original = path.read_text()
        path.write_text(mutate(original, old, new))
        try:
            ok, why = run_tests(copy, tests, timeout)
        finally:
            path.write_text(original)
        killed += not ok
        survived += ok
        result = "**survived**" if ok else "killed"
        print(
            f"| {k} | {file}:{line_number(original, old)} | {what} | {result} | "
            f"{why.removeprefix('FAILED ').removeprefix('ERROR ')} |",
            flush=True,
        )
    print(f"\n{family}: {killed + survived} mutations, {killed} killed, {survived} survived\n")
    return survived


def main() -> None:
    args = parse_args()
    families = args.family or sorted(FAMILIES)
    only = {int(k) for k in args.only.split(",")} if args.only else None
    if args.list:
        for family in families:
            for k, (file, old, new, what) in enumerate(FAMILIES[family][1], 1):
                print(f"{family} {k}: {file}: {what}\n    - {old.strip()}\n    + {new.strip()}")
        return
    survived_any = False
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        copy = Path(tmp)
        copy_repository(copy)
        check_copy(copy)
        for family in families:
            survived_any |= check_family(copy, family, only, args.timeout, args.make_test) > 0
    sys.exit(1 if survived_any else 0)


if __name__ == "__main__":
    main()
