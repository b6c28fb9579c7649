// How the node-local arena's waits treat other jobs on the machine (shm_arena.cc,
// ShmArena::waitFor): oversubscribed ranks poll with sched_yield only while no thread
// besides the local ranks is runnable. Tests of the polling itself run on shared
// machines, where other jobs come and go: they turn that check off for the process.
#pragma once

namespace pycomm {

// true: oversubscribed waits poll as on a machine without other jobs (tests only).
void shmIgnoreOtherJobs(bool ignore);

}  // namespace pycomm
