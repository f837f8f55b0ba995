from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TimeSeriesAggregationType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIME_SERIES_AGGREGATION_TYPE_SUM: _ClassVar[TimeSeriesAggregationType]
    TIME_SERIES_AGGREGATION_TYPE_AVERAGE: _ClassVar[TimeSeriesAggregationType]
TIME_SERIES_AGGREGATION_TYPE_SUM: TimeSeriesAggregationType
TIME_SERIES_AGGREGATION_TYPE_AVERAGE: TimeSeriesAggregationType

class LabelPair(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class ProfileType(_message.Message):
    __slots__ = ("ID", "name", "sample_type", "sample_unit", "period_type", "period_unit")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_UNIT_FIELD_NUMBER: _ClassVar[int]
    PERIOD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PERIOD_UNIT_FIELD_NUMBER: _ClassVar[int]
    ID: str
    name: str
    sample_type: str
    sample_unit: str
    period_type: str
    period_unit: str
    def __init__(self, ID: _Optional[str] = ..., name: _Optional[str] = ..., sample_type: _Optional[str] = ..., sample_unit: _Optional[str] = ..., period_type: _Optional[str] = ..., period_unit: _Optional[str] = ...) -> None: ...

class Labels(_message.Message):
    __slots__ = ("labels",)
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedCompositeFieldContainer[LabelPair]
    def __init__(self, labels: _Optional[_Iterable[_Union[LabelPair, _Mapping]]] = ...) -> None: ...

class Series(_message.Message):
    __slots__ = ("labels", "points")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedCompositeFieldContainer[LabelPair]
    points: _containers.RepeatedCompositeFieldContainer[Point]
    def __init__(self, labels: _Optional[_Iterable[_Union[LabelPair, _Mapping]]] = ..., points: _Optional[_Iterable[_Union[Point, _Mapping]]] = ...) -> None: ...

class Point(_message.Message):
    __slots__ = ("value", "timestamp")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    value: float
    timestamp: int
    def __init__(self, value: _Optional[float] = ..., timestamp: _Optional[int] = ...) -> None: ...

class LabelValuesRequest(_message.Message):
    __slots__ = ("name", "matchers", "start", "end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MATCHERS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    name: str
    matchers: _containers.RepeatedScalarFieldContainer[str]
    start: int
    end: int
    def __init__(self, name: _Optional[str] = ..., matchers: _Optional[_Iterable[str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LabelValuesResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class LabelNamesRequest(_message.Message):
    __slots__ = ("matchers", "start", "end")
    MATCHERS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    matchers: _containers.RepeatedScalarFieldContainer[str]
    start: int
    end: int
    def __init__(self, matchers: _Optional[_Iterable[str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LabelNamesResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetProfileStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetProfileStatsResponse(_message.Message):
    __slots__ = ("data_ingested", "oldest_profile_time", "newest_profile_time")
    DATA_INGESTED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_PROFILE_TIME_FIELD_NUMBER: _ClassVar[int]
    NEWEST_PROFILE_TIME_FIELD_NUMBER: _ClassVar[int]
    data_ingested: bool
    oldest_profile_time: int
    newest_profile_time: int
    def __init__(self, data_ingested: _Optional[bool] = ..., oldest_profile_time: _Optional[int] = ..., newest_profile_time: _Optional[int] = ...) -> None: ...
