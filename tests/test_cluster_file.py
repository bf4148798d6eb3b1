"""Attaching to engines whose ipcluster has created its cluster file but not yet written it
(labavg.jobs.cluster._cluster_file): read again until written, refused by path if it never is.
Once in a CI run a notebook attached in that moment and got a JSONDecodeError."""

from __future__ import annotations

import json
import threading

import ipyparallel as ipp
import pytest

from labavg.base.errors import UserError
from labavg.jobs.cluster import Cluster, _cluster_file


def _profile(tmp_path):
    profile = tmp_path / "profile_labavg"
    (profile / "security").mkdir(parents=True)
    cluster = ipp.Cluster(profile_dir=str(profile), cluster_id="job1")
    return profile, cluster


def test_a_cluster_file_written_after_it_appeared_is_read_once_written(tmp_path):
    profile, cluster = _profile(tmp_path)
    path = cluster.cluster_file
    open(path, "w").close()  # created, not yet written
    writer = threading.Timer(0.5, lambda: open(path, "w").write(json.dumps(cluster.to_dict())))
    writer.start()
    found = _cluster_file("labavg", "job1", 30, {"profile_dir": str(profile)})
    writer.join()
    assert found.cluster_id == "job1" and found.profile_dir == str(profile)
    assert _cluster_file("labavg", "other", 1, {"profile_dir": str(profile)}) is None


def test_a_cluster_file_that_stays_empty_is_refused_naming_it(tmp_path):
    profile, cluster = _profile(tmp_path)
    open(cluster.cluster_file, "w").close()
    with pytest.raises(UserError, match=rf"^{cluster.cluster_file}: the ipyparallel cluster file "
                                        r"is not JSON after 0.5 s \(Expecting value"):
        Cluster.attach(profile="labavg", cluster_id="job1", profile_dir=str(profile), timeout=0.5)
