// The process event both programs send to the agent's process-event thread (cpu_sampler.c for sampled
// processes, syscalls.c for every process at its first syscall): describe this process now, while it lives.
// Mirrored by agent/model.py ProcessEvent and EVENT_* (tests/agent/test_sampler_layout.py checks the struct).
#pragma once

#define EVENT_NEW  1   // first seen since it was last described
#define EVENT_EXEC 2   // it called exec: its image, maps (and maybe cgroup) changed
#define EVENT_EXIT 3   // it exited: user space keeps its description for one more drain
#define EVENT_UNMAPPED 4   // cpu_sampler.c: a walk left its known mappings (code mapped since?): read them again

struct process_event {
    u32 tgid;
    u32 kind;          // EVENT_NEW, EVENT_EXEC, EVENT_EXIT or EVENT_UNMAPPED
    u64 ns;            // bpf_ktime_get_ns() when it happened (CLOCK_MONOTONIC)
};
