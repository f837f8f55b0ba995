// The agent's --cgroup: only tasks in that cgroup (v2) or below it are sampled, traced and recorded. Its id
// is the cgroup directory's inode number, its level the directory's depth below the hierarchy's root; 0:
// every task of the node.
#pragma once

#ifndef SCOPE_CGROUP_ID
#define SCOPE_CGROUP_ID 0
#define SCOPE_CGROUP_LEVEL 0
#endif

static __always_inline int in_scope(void) {
#if SCOPE_CGROUP_ID
    return bpf_get_current_ancestor_cgroup_id(SCOPE_CGROUP_LEVEL) == SCOPE_CGROUP_ID;
#else
    return 1;
#endif
}
