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
    """TI-ONE: CreateTrainingTask, DescribeTrainingTask, StopTrainingTask, DescribeLogs.

    ``outcomes[i]`` is how the i-th created task goes after one ``RUNNING`` poll:
    ``"SUCCEED"``; ``"reclaimed"``: ``FAILED`` with a spot-reclaim reason (TI-ONE
    documents no wording; this is the Chinese console's kind of text); ``"relaunched"``:
    ``STARTING`` again with a reclaim message, then ``RUNNING``, then ``SUCCEED``, as a
    platform that brings the task back itself would. No outcomes: ``RUNNING`` forever.
    """

    RECLAIM_REASON = "竞价实例被回收"  # "the spot instance was reclaimed"
    RECLAIM_MESSAGE = "spot instance reclaimed by the system"

    def __init__(self, outcomes: list[str] | None = None) -> None:
        self.outcomes = outcomes or []
        self.actions: list[tuple[str, dict]] = []
        self.created: list[dict] = []
        self.polls: dict[str, int] = {}
        self.server = RecordingServer(self._answer)

    def _answer(self, request: Recorded) -> tuple[int, dict]:
        action, body = request.headers["x-tc-action"], request.json()
        self.actions.append((action, body))
        if action == "CreateTrainingTask":
            self.created.append(body)
            answer = {"Id": f"train-{51233 + len(self.created)}"}
        elif action == "DescribeTrainingTask":
            answer = {"TrainingTaskDetail": self._task(body["Id"])}
        elif action == "StopTrainingTask":
            answer = {}
        else:
            answer = {"Content": [{"PodName": "train-51234-worker-0", "Message": "step 1 loss 2.30"}]}
        return 200, {"Response": {**answer, "RequestId": "r"}}

    def _task(self, task_id: str) -> dict:
        polls = self.polls[task_id] = self.polls.get(task_id, 0) + 1
        index = int(task_id.removeprefix("train-")) - 51234
        outcome = self.outcomes[index] if index < len(self.outcomes) else "RUNNING"
        task = {"Id": task_id, "Name": self.created[index]["Name"] if index < len(self.created) else task_id,
                "Status": "RUNNING"}
        if polls == 1 or outcome == "RUNNING":
            return task
        if outcome == "reclaimed":
            return {**task, "Status": "FAILED", "FailureReason": self.RECLAIM_REASON, "Message": self.RECLAIM_MESSAGE}
        if outcome == "relaunched" and polls <= 3:
            return {**task, "Status": "STARTING" if polls == 2 else "RUNNING",
                    "Message": f"{self.RECLAIM_MESSAGE}; rescheduling" if polls == 2 else None}
        return {**task, "Status": "SUCCEED"}

    def creates(self) -> list:
        """The recorded CreateTrainingTask requests, headers and all."""
        return [request for request in self.server.requests if request.headers["x-tc-action"] == "CreateTrainingTask"]

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def close(self) -> None:
        self.server.close()
