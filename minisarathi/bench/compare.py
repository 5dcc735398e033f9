"""The same workload and seed under several scheduling policies: side-by-side metrics, capacities and
ratios."""

from __future__ import annotations

from dataclasses import dataclass

CHUNKED = ("sarathi", "simple_chunking")  # the policies whose behaviour depends on the chunk size


@dataclass
class Variant:
    label: str  # e.g. "sarathi-512", "vllm", "sarathi-slo"
    scheduler: str
    chunk_size: int
    slo_driven: bool = False  # tbt_slo_ms set to the capacity SLO; chunk_size only an upper bound


SLO_DRIVEN_CHUNK_SIZE = 8192  # the SLO-driven variant's token upper bound: high, so the target alone decides


def policy_variants(policies: list[str], chunk_sizes: list[int], slo_driven: bool = False) -> list[Variant]:
    """One variant per policy, and per chunk size for the chunked policies (their label names it); with
    slo_driven, last, sarathi with tbt_slo_ms = the SLO ("sarathi-slo")."""
    if not policies:
        raise ValueError("policies must name at least one scheduler")
    if not chunk_sizes or any(c < 1 for c in chunk_sizes):
        raise ValueError(f"chunk_sizes must be positive integers, got {chunk_sizes!r}")
    variants = []
    for policy in policies:
        if policy in CHUNKED:
            variants += [Variant(f"{policy}-{c}", policy, c) for c in chunk_sizes]
        else:
            # Unchunked policies admit whole prompts; the token limit only matters past max_model_len.
            variants.append(Variant(policy, policy, max(chunk_sizes)))
    if slo_driven:
        variants.append(Variant("sarathi-slo", "sarathi", SLO_DRIVEN_CHUNK_SIZE, slo_driven=True))
    return variants


def capacity_table(capacities: dict[str, float], baseline: str | None) -> str:
    """Capacity per variant and its ratio to the baseline variant (vllm when present)."""
    base = capacities.get(baseline) if baseline else None
    lines = [f"{'policy':<24}{'capacity (qps)':>16}{'ratio to ' + baseline if base else '':>20}"]
    for label, capacity in capacities.items():
        ratio = f"{capacity / base:.2f}x" if base else ""
        lines.append(f"{label:<24}{capacity:>16.3f}{ratio:>20}")
    return "\n".join(lines)


def tbt_ratio(metrics: dict[str, dict], label: str, baseline: str) -> float | None:
    """P99 TBT of `label` over the baseline's: Sarathi-Serve's headline is <= 1/3 against vLLM."""
    a, b = metrics[label]["tbt"]["p99"], metrics[baseline]["tbt"]["p99"]
    return a / b if a is not None and b else None
