"""The guest agent's side of volume mounts, without a VM: what `/init` accepts and which mounts
a restored guest lets go of. (Mounting itself: tests/e2e/test_volumes.py.)"""

from __future__ import annotations

import pytest

from aenv.agent.envd.connect import ConnectError
from aenv.agent.envd.volumes import VolumeMount, parse, served_by

MOUNTINFO = """\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 22 0:35 / /mnt/shared rw,relatime - 9p 169.254.0.22 rw,access=user,trans=tcp,port=564
41 40 0:36 / /mnt/shared/inner rw,relatime - 9p 169.254.0.22 rw,access=user,trans=tcp,port=564
42 22 0:37 / /mnt/with\\040space rw,relatime - 9p 169.254.0.22 rw,trans=tcp
43 22 0:38 / /mnt/elsewhere rw,relatime - 9p 10.0.0.1 rw,trans=tcp
44 22 0:39 / /mnt/nfs rw,relatime - nfs 169.254.0.22:/x rw
"""


def test_mounts_of_the_node_server_are_found_deepest_first() -> None:
    assert served_by("169.254.0.22", MOUNTINFO) == ["/mnt/shared/inner", "/mnt/with space", "/mnt/shared"]


def test_init_volume_mounts_are_validated() -> None:
    wanted = parse([{"path": "/mnt/data/", "export": "/v/data", "port": 564}])
    assert wanted == [VolumeMount("/mnt/data", "/v/data", 564)]
    assert parse([]) == []
    for bad in (
        {"path": "/mnt"},
        [{"path": "/mnt", "export": "/v/x"}],
        [{"path": "relative", "export": "/v/x", "port": 564}],
        [{"path": "/", "export": "/v/x", "port": 564}],
        [{"path": "/mnt\0", "export": "/v/x", "port": 564}],
        [{"path": 5, "export": "/v/x", "port": 564}],
    ):
        with pytest.raises(ConnectError):
            parse(bad)
