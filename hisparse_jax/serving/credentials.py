"""Credentials from command-line flags, shared by the server and the client: PEM files and the API key.

Every function raises ``ValueError`` with a message naming the flag at fault.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time

# The most bytes a credentials file may hold: a system CA bundle is ~0.2 MB (/etc/ssl/certs/ca-certificates.crt).
MAX_CREDENTIAL_FILE_BYTES = 4 << 20
PIPE_TIMEOUT_S = 10.0  # the longest a credentials pipe may take to end


def read_file(flag: str, path: str | None) -> bytes | None:
  """The bytes of the file a flag names (None when the flag is unset): a regular file or a pipe (``<(...)``) of
  at most MAX_CREDENTIAL_FILE_BYTES (a device such as /dev/zero was read until memory ran out)."""
  if path is None:
    return None
  try:  # (non-blocking: opening a FIFO nobody writes would wait for ever)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
  except OSError as e:
    raise ValueError(f"--{flag} {path!r}: {e.strerror}") from None
  try:
    if stat.S_ISREG(mode := os.fstat(fd).st_mode):
      os.set_blocking(fd, True)
      with open(fd, "rb", closefd=False) as f:
        data = f.read(MAX_CREDENTIAL_FILE_BYTES + 1)
    elif stat.S_ISFIFO(mode):
      data = _read_pipe(fd, flag, path)
    else:
      raise ValueError(f"--{flag} {path!r}: not a regular file or a pipe")
  except OSError as e:
    raise ValueError(f"--{flag} {path!r}: {e.strerror}") from None
  finally:
    os.close(fd)
  if len(data) > MAX_CREDENTIAL_FILE_BYTES:
    raise ValueError(f"--{flag} {path!r}: more than {MAX_CREDENTIAL_FILE_BYTES} bytes, not a credentials file")
  if not data.strip():
    raise ValueError(f"--{flag} {path!r}: empty file")
  return data


def _read_pipe(fd: int, flag: str, path: str) -> bytes:
  """At most MAX_CREDENTIAL_FILE_BYTES + 1 bytes of the pipe ``fd`` (non-blocking) until its end, which must come
  within PIPE_TIMEOUT_S (a pipe still open, or a FIFO whose writer never comes, would hang start-up)."""
  import select

  chunks, size, deadline = [], 0, time.monotonic() + PIPE_TIMEOUT_S
  while size <= MAX_CREDENTIAL_FILE_BYTES:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
      raise ValueError(f"--{flag} {path!r}: the pipe did not end within {PIPE_TIMEOUT_S:g} s")
    try:
      chunk = os.read(fd, MAX_CREDENTIAL_FILE_BYTES + 1 - size)
    except BlockingIOError:
      continue
    if not chunk:
      break
    chunks.append(chunk)
    size += len(chunk)
  return b"".join(chunks)


def bearer(api_key: str) -> str:
  """The ``authorization`` metadata value that carries api_key (the client sends it, the server expects it)."""
  return f"Bearer {api_key}"


def api_key(key: str | None, key_file: str | None, file_flag: str = "api-key-file") -> str | None:
  """The bearer token from --api-key or the file of ``file_flag`` (its first line, stripped); None if neither is
  set.

  A key must be non-empty printable ASCII without spaces (it travels in gRPC metadata)."""
  if key is not None and key_file is not None:
    raise ValueError("give --api-key or --api-key-file, not both")
  if key_file is not None:
    data = read_file(file_flag, key_file)
    try:
      key = data.decode("ascii").splitlines()[0].strip()
    except (UnicodeDecodeError, IndexError):
      raise ValueError(f"--{file_flag} {key_file!r}: the first line must be the key (ASCII)") from None
  if key is None:
    return None
  _check_key(key, "--api-key" if key_file is None else f"--{file_flag} {key_file!r}: its first line")
  return key


MAX_CLIENT_KEYS = 4096  # lines of a --client-keys-file


def _check_key(key: str, where: str) -> None:
  if not key or not (key.isascii() and key.isprintable()) or " " in key:
    raise ValueError(f"{where}: must be non-empty printable ASCII without spaces")


def client_keys(path: str | None) -> dict[str, str]:
  """name -> API key from --client-keys-file: one client a line, ``NAME KEY`` (blank lines and lines starting
  with # skipped; at most MAX_CLIENT_KEYS). A name is at most 64 printable ASCII characters; no name or key
  appears twice. {} when the flag is unset."""
  data = read_file("client-keys-file", path)
  if data is None:
    return {}
  try:
    lines = data.decode("ascii").splitlines()
  except UnicodeDecodeError:
    raise ValueError(f"--client-keys-file {path!r}: not ASCII") from None
  keys: dict[str, str] = {}
  for number, line in enumerate(lines, 1):
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    where = f"--client-keys-file {path!r} line {number}"
    words = line.split()
    if len(words) != 2:
      raise ValueError(f"{where}: expected NAME KEY")
    name, key = words
    if len(name) > 64 or not name.isprintable():
      raise ValueError(f"{where}: a name is at most 64 printable ASCII characters")
    _check_key(key, where)
    if name in keys or key in keys.values():
      raise ValueError(f"{where}: {'name ' + repr(name) if name in keys else 'its key'} appears twice")
    keys[name] = key
    if len(keys) > MAX_CLIENT_KEYS:
      raise ValueError(f"--client-keys-file {path!r}: more than {MAX_CLIENT_KEYS} keys")
  if not keys:
    raise ValueError(f"--client-keys-file {path!r}: no NAME KEY line")
  return keys


def check_pem(
  cert_file: str | None,
  key_file: str | None,
  ca_file: str | None,
  cert: bytes | None,
  key: bytes | None,
  ca: bytes | None,
  *,
  cert_flag: str = "tls-cert-file",
  key_flag: str = "tls-key-file",
  ca_flag: str = "tls-client-ca-file",
) -> None:
  """Parses the PEM bytes read from the files (``read_file``; the paths name them in messages) now, with
  Python's ``ssl``, so that a wrong file is an error naming its flag at start-up, not a failed bind or handshake
  later: the certificate chain with its private key (unencrypted, as gRPC needs), and the CA certificates.
  The bytes are parsed from in-memory files, not the paths again: a pipe (``<(...)``) is empty by then, and a
  FIFO would wait for a writer."""
  import ssl

  if cert is not None and key is not None:
    try:
      with _memory_file(cert) as cert_path, _memory_file(key) as key_path:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
    except (ssl.SSLError, OSError) as e:
      raise ValueError(
        f"--{cert_flag} {cert_file!r} / --{key_flag} {key_file!r}: not a PEM certificate chain and "
        f"its unencrypted private key{_why(e)}"
      ) from None
  if ca is not None:
    try:
      with _memory_file(ca) as ca_path:
        ssl.create_default_context(cafile=ca_path)
    except (ssl.SSLError, OSError) as e:
      raise ValueError(f"--{ca_flag} {ca_file!r}: not a PEM CA certificate file{_why(e)}") from None


@contextlib.contextmanager
def _memory_file(data: bytes):
  """A path to a file in memory holding ``data`` (Linux memfd; nothing is written to disk: it may be a key)."""
  fd = os.memfd_create("pem", os.MFD_CLOEXEC)
  try:
    with open(fd, "wb", closefd=False) as f:
      f.write(data)
    yield f"/proc/self/fd/{fd}"
  finally:
    os.close(fd)


def _why(e: OSError) -> str:
  """OpenSSL's reason (e.g. " (KEY_VALUES_MISMATCH)"), or the OS error's; "" when it gives none."""
  import ssl

  why = e.reason if isinstance(e, ssl.SSLError) else e.strerror
  return f" ({why})" if why else ""
