"""Export a shared library's prefixed symbols under their plain names (ELF64, little endian).

The runtime-dispatching OpenBLAS wheel (`scipy-openblas32`) prefixes every symbol
(`scipy_cblas_sgemm`), so MLX, which asks for `cblas_sgemm`, cannot bind to it. We write
a copy of the library in which each chosen dynamic symbol's name starts `len(prefix)` bytes
further into the string it already has (`scipy_cblas_sgemm` -> `cblas_sgemm`: no string
is added), and rebuild the `.gnu.hash` table for the new names.

The rebuilt table has one bucket and keeps the original Bloom filter size: the dynamic
linker tests the filter first (so a lookup of a name we do not define stays cheap) and
walks one chain only on a filter hit. GNU hash requires the symbols of a bucket to be
contiguous; with one bucket that holds for any order, so `.dynsym` is left as it is.

A symbol that the library itself calls through a relocation keeps its name: renaming it
would leave that call unresolved. This module must not import mlx.
"""

from __future__ import annotations

import struct

SHT_RELA = 4
SHT_DYNSYM = 11
SHT_GNU_HASH = 0x6FFFFFF6
SYM_SIZE = 24


def gnu_hash(name: bytes) -> int:
    """The dynamic linker's GNU hash (dl_new_hash): h = h * 33 + c, from 5381."""
    h = 5381
    for c in name:
        h = (h * 33 + c) & 0xFFFFFFFF
    return h


class ElfError(ValueError):
    """The file is not a library this module can rewrite."""


def _sections(data: bytes) -> list[dict]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    out = []
    for i in range(shnum):
        _, kind, _, _, off, size, link, _, _, _ = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        out.append({"index": i, "type": kind, "off": off, "size": size, "link": link})
    return out


def _one(sections: list[dict], kind: int, what: str) -> dict:
    found = [s for s in sections if s["type"] == kind]
    if len(found) != 1:
        raise ElfError(f"expected one {what} section, found {len(found)}")
    return found[0]


def _name(data: bytes, strtab: dict, offset: int) -> bytes:
    start = strtab["off"] + offset
    return bytes(data[start : data.index(b"\0", start)])


def _relocated_symbols(data: bytes, sections: list[dict], dynsym_index: int) -> set[int]:
    """Indices of dynamic symbols that a relocation of the library itself refers to."""
    used: set[int] = set()
    for sec in sections:
        if sec["type"] != SHT_RELA or sec["link"] != dynsym_index:
            continue
        for at in range(sec["off"], sec["off"] + sec["size"], 24):
            (info,) = struct.unpack_from("<Q", data, at + 8)
            used.add(info >> 32)
    return used


def dynamic_symbols(data: bytes) -> list[bytes]:
    """Names of the dynamic symbol table, in order."""
    sections = _sections(data)
    dynsym = _one(sections, SHT_DYNSYM, ".dynsym")
    strtab = sections[dynsym["link"]]
    return [
        _name(data, strtab, struct.unpack_from("<I", data, dynsym["off"] + SYM_SIZE * i)[0])
        for i in range(dynsym["size"] // SYM_SIZE)
    ]


def gnu_lookup(data: bytes, name: bytes, names: list[bytes] | None = None) -> int | None:
    """Index of `name` found through the GNU hash table, as the dynamic linker finds it.

    `names` (from `dynamic_symbols(data)`) saves re-reading the table on many lookups.
    """
    table = _one(_sections(data), SHT_GNU_HASH, ".gnu.hash")
    names = dynamic_symbols(data) if names is None else names
    nbuckets, symoffset, bloom_size, shift = struct.unpack_from("<IIII", data, table["off"])
    h = gnu_hash(name)
    (word,) = struct.unpack_from("<Q", data, table["off"] + 16 + 8 * ((h // 64) % bloom_size))
    if not (word >> (h % 64)) & 1 or not (word >> ((h >> shift) % 64)) & 1:
        return None
    buckets_at = table["off"] + 16 + 8 * bloom_size
    (index,) = struct.unpack_from("<I", data, buckets_at + 4 * (h % nbuckets))
    chain_at = buckets_at + 4 * nbuckets
    while index:
        (link,) = struct.unpack_from("<I", data, chain_at + 4 * (index - symoffset))
        if (link | 1) == (h | 1) and names[index] == name:
            return index
        if link & 1:
            return None
        index += 1
    return None


def strip_symbol_prefix(data: bytes, prefix: bytes, only: bytes) -> tuple[bytes, list[bytes]]:
    """A copy of `data` whose symbols starting with `only` lose their leading `prefix`.

    `only` starts with `prefix` (e.g. prefix b"scipy_", only b"scipy_cblas_"). Returns
    (new image, names exported under their new name). Symbols the library relocates
    against keep their names.
    """
    if not only.startswith(prefix):
        raise ValueError("`only` must start with `prefix`")
    out = bytearray(data)
    sections = _sections(data)
    dynsym = _one(sections, SHT_DYNSYM, ".dynsym")
    table = _one(sections, SHT_GNU_HASH, ".gnu.hash")
    strtab = sections[dynsym["link"]]
    keep = _relocated_symbols(data, sections, dynsym["index"])
    names: list[bytes] = []
    renamed: list[bytes] = []
    for i in range(dynsym["size"] // SYM_SIZE):
        at = dynsym["off"] + SYM_SIZE * i
        (offset,) = struct.unpack_from("<I", data, at)
        name = _name(data, strtab, offset)
        if name.startswith(only) and i not in keep:
            struct.pack_into("<I", out, at, offset + len(prefix))
            name = name[len(prefix) :]
            renamed.append(name)
        names.append(name)
    _, symoffset, bloom_size, shift = struct.unpack_from("<IIII", data, table["off"])
    out[table["off"] : table["off"] + table["size"]] = _gnu_hash_table(
        names, symoffset, bloom_size, shift, table["size"]
    )
    return bytes(out), renamed


def _gnu_hash_table(names: list[bytes], symoffset: int, bloom_size: int, shift: int, size: int) -> bytes:
    hashes = [gnu_hash(n) for n in names[symoffset:]]
    bloom = [0] * bloom_size
    for h in hashes:
        bloom[(h // 64) % bloom_size] |= (1 << (h % 64)) | (1 << ((h >> shift) % 64))
    chain = [h & ~1 for h in hashes]
    if chain:
        chain[-1] |= 1
    table = struct.pack("<IIII", 1, symoffset, bloom_size, shift)
    table += struct.pack(f"<{bloom_size}Q", *bloom)
    table += struct.pack("<I", symoffset if chain else 0)
    table += struct.pack(f"<{len(chain)}I", *chain)
    if len(table) > size:
        raise ElfError(f"rebuilt .gnu.hash needs {len(table)} bytes, the section has {size}")
    return table + b"\0" * (size - len(table))
