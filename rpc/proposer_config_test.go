package rpc

import (
	"strings"
	"testing"
)

func TestProposerConfigValidate(t *testing.T) {
	if err := DefaultProposerConfig().Validate(); err != nil {
		t.Fatalf("default: %v", err)
	}
	for _, c := range []struct {
		cfg  ProposerConfig
		want string
	}{
		{ProposerConfig{MaxBatch: 0, MaxInflight: 2}, "--max-entry-ops) is 0"},
		{ProposerConfig{MaxBatch: 1 << 20, MaxInflight: 2}, "--max-entry-ops) is 1048576"},
		{ProposerConfig{MaxBatch: 1024, MaxInflight: 0}, "--max-entries-in-flight) is 0"},
		{ProposerConfig{MaxBatch: 1024, MaxInflight: 65}, "--max-entries-in-flight) is 65"},
	} {
		err := c.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err %v, want one containing %q", c.cfg, err, c.want)
		}
	}
}
