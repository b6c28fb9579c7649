// Single-copy check for the shared-memory path (issue #3): how fast can one process
// read another's memory with cross-memory attach (process_vm_readv) compared with
// memcpy of the same 64 MiB in the same chunks into a cache-sized buffer?
//   gcc -O2 -o /tmp/cma_read benchmarks/cma_read.c && /tmp/cma_read [chunk_bytes]
// Results on the project VM are in benchmarks/README.md ("Single copy").
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t total = (size_t)64 << 20;
  const size_t chunk = argc > 1 ? (size_t)atol(argv[1]) : 262144;
  if (chunk == 0 || total % chunk != 0) {
    fprintf(stderr, "chunk_bytes must divide 64 MiB\n");
    return 2;
  }
  char* src = aligned_alloc(4096, total);
  char* tmp = aligned_alloc(4096, chunk);
  memset(src, 1, total);
  memset(tmp, 0, chunk);
  int ready[2], done[2];
  if (pipe(ready) || pipe(done)) return 1;
  const pid_t child = fork();
  if (child == 0) {  // owns its own (written, so unshared) copy of src at the same address
    char c = 'r';
    memset(src, 2, total);
    if (write(ready[1], &c, 1) != 1 || read(done[0], &c, 1) != 1) _exit(1);
    _exit(0);
  }
  char c;
  if (read(ready[0], &c, 1) != 1) return 1;
  for (int rep = 0; rep < 3; ++rep) {
    double t = seconds();
    for (size_t off = 0; off < total; off += chunk) {
      struct iovec local = {tmp, chunk}, remote = {src + off, chunk};
      if (process_vm_readv(child, &local, 1, &remote, 1, 0) != (ssize_t)chunk) {
        perror("process_vm_readv");
        return 1;
      }
    }
    const double cma = seconds() - t;
    if (tmp[0] != 2) return 1;  // read the child's bytes, not ours
    t = seconds();
    for (size_t off = 0; off < total; off += chunk) memcpy(tmp, src + off, chunk);
    const double copy = seconds() - t;
    printf("chunk %zu B: process_vm_readv %.2f GB/s, memcpy %.2f GB/s\n", chunk, total / cma / 1e9,
           total / copy / 1e9);
  }
  c = 'd';
  if (write(done[1], &c, 1) != 1) return 1;
  waitpid(child, NULL, 0);
  return 0;
}
