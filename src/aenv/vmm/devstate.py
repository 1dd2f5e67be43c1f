"""Device state: splitting a template's migration stream and splicing sandbox device state into it.

A template is saved with `migrate` and `x-ignore-shared`, which gives a stream of header,
configuration and RAM section headers (no pages: RAM lives in the memory image) followed by the
device sections. `xen-save-devices-state` (any QEMU build has it) writes just the device
sections. The prefix is everything before the first device section; a restorable stream for
any later state of a sandbox from that template is prefix + that sandbox's device sections.
QEMU then logs "Expected vmdescription section", which is harmless: the description is
debugging metadata.
"""

from __future__ import annotations

_MAGIC = b"QEVM"
_SECTION_FULL = 0x04
_FILE_HEADER = 8  # magic + version


class DeviceStateError(ValueError):
    """A migration stream or device state file is not what this QEMU writes."""


def _check_header(data: bytes, what: str) -> None:
    if len(data) < _FILE_HEADER + 6 or data[:4] != _MAGIC:
        raise DeviceStateError(f"{what} is not a QEMU migration stream")


def first_section_header(devices: bytes) -> bytes:
    """The bytes that open the first device section: type, section id, id string."""
    _check_header(devices, "device state")
    if devices[_FILE_HEADER] != _SECTION_FULL:
        raise DeviceStateError("device state does not start with a full device section")
    id_length = devices[_FILE_HEADER + 5]
    return devices[_FILE_HEADER : _FILE_HEADER + 6 + id_length]


def split_prefix(stream: bytes, devices: bytes) -> bytes:
    """The part of a template's stream that precedes its device sections."""
    _check_header(stream, "template stream")
    if stream[:_FILE_HEADER] != devices[:_FILE_HEADER]:
        raise DeviceStateError("template stream and device state come from different QEMU formats")
    marker = first_section_header(devices)
    position = stream.find(marker, _FILE_HEADER)
    if position < 0:
        raise DeviceStateError("template stream has no device section matching the device state")
    return stream[:position]


def splice(prefix: bytes, devices: bytes) -> bytes:
    """A stream `migrate-incoming` accepts: the template prefix followed by these device sections."""
    _check_header(prefix, "stream prefix")
    first_section_header(devices)
    return prefix + devices[_FILE_HEADER:]
