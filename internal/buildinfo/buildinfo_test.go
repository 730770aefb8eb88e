package buildinfo

import (
	"strings"
	"testing"
)

func TestShortAndString(t *testing.T) {
	i := read("v1.4.0", "1a2b3c")
	if got, want := i.Short(), "v1.4.0 (commit 1a2b3c)"; got != want {
		t.Errorf("Short() = %q, want %q", got, want)
	}
	if got, want := i.String(), "quotad v1.4.0 (commit 1a2b3c) "+i.GoVersion; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got := read("", "").Short(); !strings.HasPrefix(got, "dev") {
		t.Errorf("Short() of an unstamped build = %q, want it to start with dev", got)
	}
}
