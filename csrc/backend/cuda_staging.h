// CUDA tensors through the CPU collectives: the first, simple path, the CUDA
// device seam (device_seam.h). Compiled only into the CUDA build (PYCOMM_WITH_CUDA),
// where cuda_staging.cc registers it for c10::DeviceType::CUDA while the extension
// loads; tests/kernels/test_cuda.py validates it where a GPU is lent. What has run where:
// docs/architecture.md, "CUDA".
//
// ProcessGroupPycomm's entry points declare their tensors by role; a call whose
// tensors are on the CPU runs on them as they are. A call with CUDA tensors
//  1. checks they are on one device, strided and contiguous, with no tensor of
//     another device beside them (DeviceProbe; usage errors raise);
//  2. enqueues a copy of each input (role in / inout) into a pinned host twin on
//     the caller's current stream and records an event there (no host
//     synchronisation); an output gets a twin without the copy (but a receive's
//     does get it: a shorter message leaves the rest of the tensor as it was), and a
//     tensor declared twice shares one twin;
//  3. runs the CPU collective on the twins, always queued (the Launch forces
//     asyncOp), with a pre-body step, handed to enqueue in the Launch, in which the
//     worker waits on that event before the body;
//  4. when the CPU collective completes (on the worker), enqueues the copies of
//     the output twins back to the device on a side stream that first waits on
//     the call's event, records that stream on the outputs for the caching
//     allocator, and completes a CUDA Future there;
//  5. hands torch a StagedWork: its wait() (and the Future's wait/then) makes the
//     caller's current stream wait on that Future's events: the device work after
//     wait() is ordered after the results landed, and the host blocks only until
//     the collective is done.
// send() (Dispatch::kDirect: point-to-point does not pass through the worker
// queue) waits on its copy-in event on the caller's thread before the transport
// reads the twin. Same-host CUDA IPC, pipelined segments and reductions in CUDA
// kernels are not done yet (docs/architecture.md).
#pragma once

#ifdef PYCOMM_WITH_CUDA

#include "backend/device_seam.h"

namespace pycomm {

// The CUDA seam (registered for c10::DeviceType::CUDA by cuda_staging.cc).
DeviceSeam& cudaSeam();

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
