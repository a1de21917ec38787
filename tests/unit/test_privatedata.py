"""Reading slurm.conf's PrivateData (dsstage.privatedata.hides_jobs_in)."""

from __future__ import annotations

import pytest
from dsstage.privatedata import hides_jobs_in


@pytest.mark.parametrize("text,hides", [
    ("", False),
    ("PrivateData=jobs\n", True),
    ("privatedata = JOBS,usage\n", True),
    ('PrivateData="accounts,jobs"\n', True),
    ("  PrivateData=usage,jobs  # users see their own\n", True),
    ("PrivateData=usage\n", False),
    ("#PrivateData=jobs\n", False),
    ("PrivateData=jobs\nPrivateData=usage\n", False),  # the last one wins
    ("PrivateData=usage\nPrivateData=jobs\n", True),
    ("ClusterName=x PrivateData=jobs\n", False),  # a setting starts its line
    ("PrivateDataX=jobs\n", False),
    ("PrivateData=jobs Partition=x\n", True),
    ("PrivateData=jo bs\n", False),
    ("PrivateData\n", False),
    ("PrivateData=#jobs\n", False),
])
def test_private_data_hides_jobs_as_slurm_reads_it(text, hides):
    assert hides_jobs_in(text) is hides
