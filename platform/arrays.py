"""Users' ``.npy`` and ``.npz`` files read without pickle and without trusting their headers.

``np.load`` believes a header: a corrupt or hostile ``.npy`` that claims 10^12 elements
makes it try to allocate them, and a truncated archive ends in a zipfile traceback. Here
the header is read first and checked against the bytes that are really there, and every
failure is a ``ValueError`` naming the file and what is wrong with it.
"""

from __future__ import annotations

import io
import zipfile

import numpy as np


def load_npy(raw: bytes, what: str) -> np.ndarray:
    """The array in ``raw`` (the bytes of a ``.npy`` file called ``what`` in messages)."""
    buf = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{what} is not a valid .npy file ({exc})") from None
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects (dtype {dtype}): it would need pickle to load, which is refused; save plain numbers")
    claimed = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize if shape else dtype.itemsize
    present = len(raw) - buf.tell()
    if claimed > present:
        raise ValueError(f"{what}: its header claims a {dtype} array of shape {tuple(shape)} ({claimed:,} bytes) "
                         f"but the file holds {present:,} bytes after the header: it is truncated or corrupt")
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{what} is not a valid .npy file ({exc})") from None


def load_npz(raw: bytes, what: str) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` archive in ``raw``, by name (without ``.npy``)."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            members = [n for n in z.namelist() if n.endswith(".npy")]
            return {n[: -len(".npy")]: load_npy(z.read(n), f"{what}[{n[:-4]}]") for n in members}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
        raise ValueError(f"{what} is not a valid .npz archive ({exc})") from None
