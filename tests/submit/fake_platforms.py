"""Loopback stand-ins for the PAI-DLC and TI-ONE APIs, answering what the official SDK
clients send (the SDKs build and sign the requests for real)."""

from __future__ import annotations

import re

from tests.submit.recording import Recorded, RecordingServer


class FakeDlc:
    """PAI-DLC: CreateJob, GetJob, StopJob, GetPodLogs. ``outcomes[i]`` is the end state
    of the i-th created job: ``"Succeeded"`` or ``"reclaimed"`` (Failed by a spot reclaim)."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = outcomes
        self.created: list[dict] = []
        self.stopped: list[str] = []
        self.polls: dict[str, int] = {}
        self.failing_polls = 0
        """GetJob calls still to answer with a server error."""
        self.server = RecordingServer(self._answer)

    def _answer(self, request: Recorded) -> tuple[int, dict]:
        action = request.headers.get("x-acs-action")
        if action == "CreateJob":
            self.created.append(request.json())
            return 200, {"JobId": f"dlc{len(self.created):04d}", "RequestId": "r"}
        job_id = re.match(r"/api/v1/jobs/([^/?]+)", request.path)[1]
        if action == "StopJob":
            self.stopped.append(job_id)
            return 200, {"JobId": job_id, "RequestId": "r"}
        if action == "GetPodLogs":
            return 200, {"JobId": job_id, "Logs": ["step 1 loss 2.30", "step 2 loss 2.10"], "RequestId": "r"}
        if self.failing_polls:
            self.failing_polls -= 1
            return 503, {"Code": "ServiceUnavailable", "Message": "try again", "RequestId": "r"}
        return 200, self._job(job_id)

    def _job(self, job_id: str) -> dict:
        # Running on the first poll, then its outcome.
        polls = self.polls[job_id] = self.polls.get(job_id, 0) + 1
        index = int(job_id.removeprefix("dlc")) - 1
        spec = self.created[index]["JobSpecs"][0]
        job = {"JobId": job_id, "Status": "Running", "JobSpecs": [spec],
               "Pods": [{"PodId": f"{job_id}-worker-0", "Type": "Worker", "Status": "Running"}], "RequestId": "r"}
        if polls > 1 and self.outcomes[index] == "reclaimed":
            job.update(Status="Failed", ReasonCode="SpotInstanceReclaimed",
                       ReasonMessage="the spot instance was reclaimed by the system")
        elif polls > 1:
            job["Status"] = "Succeeded"
        return job

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def close(self) -> None:
        self.server.close()


class FakeTione:
    """TI-ONE: CreateTrainingTask, DescribeTrainingTask, StopTrainingTask, DescribeLogs."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, dict]] = []
        self.server = RecordingServer(self._answer)

    def _answer(self, request: Recorded) -> tuple[int, dict]:
        action, body = request.headers["x-tc-action"], request.json()
        self.actions.append((action, body))
        answers = {
            "CreateTrainingTask": {"Id": "train-51234"},
            "DescribeTrainingTask": {"TrainingTaskDetail": {"Id": body.get("Id"), "Status": "RUNNING"}},
            "StopTrainingTask": {},
            "DescribeLogs": {"Content": [{"PodName": "train-51234-worker-0", "Message": "step 1 loss 2.30"}]},
        }
        return 200, {"Response": {**answers[action], "RequestId": "r"}}

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def close(self) -> None:
        self.server.close()
