"""Spherical k-means (cosine similarity) and its balanced variant (every cluster exactly n / k members).

Seeding is k-means++ (Arthur and Vassilvitskii 2007) with distance 1 - cos; a cluster that empties is
re-seeded with the point its centroid set fits worst. Balanced assignment is greedy by regret: points with the
largest gap between their best and second-best cluster choose first, each taking the best cluster with room
(equal-size clusters, as MoEfication needs to cut an FFN into equal experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def kmeans_pp(xn: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """k-means++ seeds on the unit sphere: xn [n, d] unit rows -> centroids [k, d]."""
    n = xn.shape[0]
    first = int(torch.randint(n, (1,), generator=generator))
    centroids = [xn[first]]
    dist = (1 - xn @ xn[first]).clamp_min(0)  # [n]
    for _ in range(1, k):
        weights = dist if float(dist.sum()) > 0 else torch.ones(n)
        pick = int(torch.multinomial(weights, 1, generator=generator))
        centroids.append(xn[pick])
        dist = torch.minimum(dist, (1 - xn @ xn[pick]).clamp_min(0))
    return torch.stack(centroids)  # [k, d]


def spherical_kmeans(x: Tensor, k: int, iters: int = 30, seed: int = 0) -> tuple[Tensor, Tensor]:
    """x [n, d] -> (unit centroids [k, d], labels [n]): each point to the centroid of highest cosine."""
    if not 1 <= k <= x.shape[0]:
        raise ValueError(f"cannot make {k} clusters of {x.shape[0]} points")
    xn = F.normalize(x.float(), dim=1)  # [n, d]
    centroids = kmeans_pp(xn, k, torch.Generator().manual_seed(seed))
    labels = torch.full((x.shape[0],), -1, dtype=torch.long)
    for _ in range(iters):
        sim = xn @ centroids.T  # [n, k]
        new = sim.argmax(dim=1)  # [n]
        if torch.equal(new, labels):
            break
        labels = new
        centroids = _update(xn, labels, k, sim)
    return centroids, labels


def balanced_kmeans(x: Tensor, k: int, iters: int = 15, seed: int = 0) -> Tensor:
    """x [n, d] with k | n -> labels [n], each of the k clusters exactly n / k points (cosine similarity)."""
    n = x.shape[0]
    if k < 1 or n % k:
        raise ValueError(f"cannot cut {n} points into {k} equal clusters")
    xn = F.normalize(x.float(), dim=1)  # [n, d]
    centroids, _ = spherical_kmeans(xn, k, iters=5, seed=seed)
    labels = torch.full((n,), -1, dtype=torch.long)
    for _ in range(iters):
        sim = xn @ centroids.T  # [n, k]
        new = balanced_assign(sim, n // k)
        if torch.equal(new, labels):
            break
        labels = new
        centroids = _update(xn, labels, k, sim)
    return labels


def balanced_assign(sim: Tensor, capacity: int) -> Tensor:
    """sim [n, k] -> labels [n]: at most `capacity` points per cluster.

    Points that care most go first (largest gap between their best and second-best similarity), each to its
    most similar cluster that still has room.
    """
    n, k = sim.shape
    if n > capacity * k:
        raise ValueError(f"{n} points do not fit {k} clusters of {capacity}")
    ranked = sim.argsort(dim=1, descending=True)  # [n, k] clusters by preference
    top2 = sim.gather(1, ranked[:, :2]) if k > 1 else torch.cat([sim, sim], dim=1)  # [n, 2]
    order = (top2[:, 0] - top2[:, 1]).argsort(descending=True).tolist()
    preferences = ranked.tolist()
    labels = [-1] * n
    room = [capacity] * k
    for point in order:
        cluster = next(c for c in preferences[point] if room[c])
        labels[point] = cluster
        room[cluster] -= 1
    return torch.tensor(labels, dtype=torch.long)


def _update(xn: Tensor, labels: Tensor, k: int, sim: Tensor) -> Tensor:
    """Mean direction of each cluster; an empty cluster takes the point worst served by its centroid."""
    sums = torch.zeros(k, xn.shape[1]).index_add_(0, labels, xn)  # [k, d]
    counts = torch.bincount(labels, minlength=k)  # [k]
    fit = sim.gather(1, labels[:, None]).squeeze(1).clone()  # [n] each point's similarity to its centroid
    for cluster in (counts == 0).nonzero().flatten().tolist():
        worst = int(fit.argmin())
        sums[cluster] = xn[worst]
        fit[worst] = float("inf")
    return F.normalize(sums, dim=1)
