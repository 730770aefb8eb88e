package config

import (
	"fmt"
	"strconv"
)

// Error is one problem in a limits file. Parse and LoadFile return every problem they find,
// joined with errors.Join; use errors.As to reach the individual *Error values.
type Error struct {
	// File is the name given to Parse (or the path given to LoadFile). Empty when the error
	// is not tied to a file (Merge of already parsed Limits).
	File string
	// Line is 1-based; 0 when unknown.
	Line int
	// Path is the key path of the offending field, e.g. descriptors[0].rate_limit.unit.
	// Empty for problems with a whole document.
	Path string
	// Msg says what is wrong, quoting the value, and what to do about it.
	Msg string
}

func (e *Error) Error() string {
	s := ""
	switch {
	case e.File != "" && e.Line > 0:
		s = e.File + ":" + strconv.Itoa(e.Line) + ": "
	case e.File != "":
		s = e.File + ": "
	case e.Line > 0:
		s = "line " + strconv.Itoa(e.Line) + ": "
	}
	if e.Path != "" {
		s += e.Path + ": "
	}
	return s + e.Msg
}

// newError builds an *Error.
func newError(file string, line int, path, format string, args ...any) *Error {
	return &Error{File: file, Line: line, Path: path, Msg: fmt.Sprintf(format, args...)}
}
